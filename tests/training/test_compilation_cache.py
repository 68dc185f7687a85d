"""The commands' persistent compilation cache (hybridrec._compilation_cache)."""

from __future__ import annotations

from pathlib import Path

from hybridrec.cli._compilation_cache import CACHE_ENV, cache_directory


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assert cache_directory() == tmp_path / "cache"
    for off in ("off", "", "0", "none"):
        monkeypatch.setenv(CACHE_ENV, off)
        assert cache_directory() is None
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_directory() == tmp_path / "xdg" / "hybridrec" / "jax"


def test_a_second_run_of_the_same_shapes_loads_the_compiled_step(
    dataset, small_model, training, cli, tmp_path
):
    """The first run writes the train step's executable; the second finds it there."""
    cache = tmp_path / "cache"
    settings = small_model("data.max_steps=3")
    # every program cached, however fast it compiles on this machine
    env = {
        CACHE_ENV: str(cache),
        "JAX_LOG_COMPILES": "1",
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    first = cli(*training.args(dataset, tmp_path / "one", "--quiet", *settings), env=env)
    entries = sorted(path.name for path in Path(cache).iterdir())
    assert any(name.startswith("jit_train_step") for name in entries), entries
    assert "cache hit for 'jit_train_step'" not in first.stderr
    second = cli(*training.args(dataset, tmp_path / "two", "--quiet", *settings), env=env)
    assert "Persistent compilation cache hit for 'jit_train_step'" in second.stderr
    off = cli(
        *training.args(dataset, tmp_path / "three", "--quiet", *settings),
        env={CACHE_ENV: "off", "JAX_LOG_COMPILES": "1"},
    )
    assert "Persistent compilation cache hit" not in off.stderr
