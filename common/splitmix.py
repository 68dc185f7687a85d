"""splitmix64's constants, for the two places that mix ids with it: the store's numpy and
native kernels (`embedding_store._hashing`, initial rows) and the jitted step that gives
new ids their rows on the devices (`model.device_ids`), which must draw the same values."""

GOLDEN = 0x9E3779B97F4A7C15  # the counter's step; a salt's offset is (salt + 1) * GOLDEN
MUL1 = 0xBF58476D1CE4E5B9
MUL2 = 0x94D049BB133111EB
COLUMN_STEP = 0xD1B54A32D192ED03  # an initial row's step between its columns' counters
MASK64 = (1 << 64) - 1
