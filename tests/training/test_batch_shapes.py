"""The sizes the device tables' batch arrays are padded to (training.batch_shapes)."""

from hybridrec.training.batch_shapes import PaddedSizes, bucket


def test_bucket_is_the_power_of_two_at_or_above():
    assert [bucket(n) for n in (0, 1, 2, 3, 256, 257, 40_000)] == [1, 1, 2, 4, 256, 512, 65536]


def test_grown_sizes_never_shrink():
    sizes = PaddedSizes()
    assert [sizes.grow("t", n) for n in (300, 100, 600, 2)] == [512, 512, 1024, 1024]
    assert sizes.grow("other", 3) == 4  # per key


def test_a_fitted_size_shrinks_only_once_its_padding_cost_more_than_a_compile():
    sizes = PaddedSizes(waste_bytes=30_000)
    assert sizes.fit("new", 3000, 4) == 4096  # grows at once
    # 4096 - 512 = 3584 entries of 4 bytes padded per batch: the third passes 30,000 bytes
    assert [sizes.fit("new", 500, 4) for _ in range(3)] == [4096, 4096, 512]
    assert sizes.fit("new", 5000, 4) == 8192  # and grows at once again
    # it comes down to the largest size needed since it last changed, not the last one
    assert [sizes.fit("new", n, 4) for n in (2000, 100, 100)] == [8192, 2048, 2048]
    # a size needed all along (no padding) never shrinks, however long it runs
    assert all(sizes.fit("new", 2048, 4) == 2048 for _ in range(100))
