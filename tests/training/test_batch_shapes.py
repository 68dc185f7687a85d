"""The sizes the device tables' batch arrays are padded to (training.device.batch_shapes)."""

import jax
import jax.numpy as jnp
from hybridrec.training.device.batch_shapes import WINDOW, AheadCompiler, PaddedSizes, bucket
from hybridrec.training.meters import CompileMeter


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


def test_with_a_hook_a_smaller_size_is_announced_and_taken_delay_batches_later():
    announced = []
    sizes = PaddedSizes(waste_bytes=30_000, ahead=lambda *a: announced.append(a), delay=4)
    assert sizes.fit("new", 3000, 4) == 4096
    assert [sizes.fit("new", 500, 4) for _ in range(3)] == [4096] * 3
    assert announced == [("new", 512)]  # chosen at the third batch, compiled ahead
    assert [sizes.fit("new", 500, 4) for _ in range(5)] == [4096, 4096, 4096, 512, 512]
    assert announced == [("new", 512)]  # once


def test_an_announced_size_is_dropped_when_a_batch_needs_more_before_it_is_taken():
    announced = []
    sizes = PaddedSizes(waste_bytes=30_000, ahead=lambda *a: announced.append(a), delay=4)
    sizes.fit("new", 3000, 4)
    assert [sizes.fit("new", n, 4) for n in (500, 500, 500, 1000)] == [4096] * 4
    # 1024 no longer fits 512: the next smaller size holds every batch since the last change
    assert announced == [("new", 512), ("new", 1024)]
    assert [sizes.fit("new", 900, 4) for _ in range(4)] == [4096, 4096, 4096, 1024]


def test_the_ahead_compiler_builds_the_step_its_call_then_reuses():
    """A step compiled ahead for shapes still to come (a donated state, as the train step
    donates it): the call with those shapes compiles nothing; one with others does."""
    step = jax.jit(lambda state, batch: state + batch["x"].sum(), donate_argnums=(0,))
    compiler = AheadCompiler(step)
    assert compiler({"x": (64, 4)}) is None  # no step seen yet: nothing to go by
    state, batch = jnp.zeros(()), {"x": jnp.ones((16, 4)), "y": jnp.ones(3)}
    compiler.saw(state, batch)
    state = step(state, batch)  # donates the state the compiler saw
    assert compiler({"x": (64, 4)}).result()
    ahead, other = ({"x": jnp.ones((n, 4)), "y": jnp.ones(3)} for n in (64, 32))
    meter = CompileMeter()
    try:
        state = step(state, ahead)
        assert meter.read()["compiles"] == 0
        state = step(state, other)
        assert meter.read()["compiles"] == 1
    finally:
        meter.close()
        compiler.close()
    assert float(state) == 16 * 4 + 64 * 4 + 32 * 4
    assert compiler({"x": (128, 4)}) is None  # closed: nothing more, no arrays kept


def test_a_size_comes_down_to_what_the_last_batches_needed():
    """Tables that filled: the size comes down past what the first batches after it grew
    needed, to the last `WINDOW` batches' largest need, in one compile."""
    sizes = PaddedSizes(waste_bytes=1_000_000)
    assert sizes.fit("new", 3000, 4) == 4096
    out = [sizes.fit("new", n, 4) for n in [2000] * 2 + [100] * 100]
    assert sorted(set(out), reverse=True) == [4096, 128]
    # the padding passes 1 MB at the 62nd batch of 100: the 2000s are out of the window
    assert out.index(128) == 2 + 61 and WINDOW < 61
    # a batch that needs the whole size again starts the count over
    sizes = PaddedSizes(waste_bytes=30_000)
    sizes.fit("new", 3000, 4)
    assert [sizes.fit("new", n, 4) for n in (500, 500, 3000, 500, 500)] == [4096] * 5
