import dataclasses
from typing import Literal

import pytest
from hybridrec.common import config
from hybridrec.common.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner:
    width: int = 4  # units per layer
    kind: Literal["a", "b"] = "a"  # which variant


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outer:
    name: str = "x"  # run name
    rate: float = 0.1  # learning rate
    layers: tuple[int, ...] = (1, 2)  # layer widths
    inner: Inner = dataclasses.field(default_factory=Inner)  # nested section

    def __post_init__(self):
        if self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")


def test_round_trip_and_overrides():
    built = config.from_dict(
        Outer, config.apply_overrides({}, ["inner.width=8", "layers=[3, 4]", "rate=1"])
    )
    assert built == Outer(inner=Inner(width=8), layers=(3, 4), rate=1.0)
    assert config.from_dict(Outer, config.to_dict(built)) == built


def test_unknown_key_names_dotted_path_and_suggestion():
    with pytest.raises(ConfigError, match=r"inner\.widht.*did you mean inner\.width"):
        config.from_dict(Outer, {"inner": {"widht": 3}})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"rate": "fast"}, "rate: expected a number"),
        ({"inner": {"kind": "c"}}, "inner.kind: 'c' is not one of"),
        ({"layers": [1, "x"]}, r"layers\[1\]: expected an integer"),
        ({"rate": -1.0}, "rate must be > 0"),
    ],
)
def test_bad_values(data, message):
    with pytest.raises(ConfigError, match=message):
        config.from_dict(Outer, data)


def test_bare_word_override_is_string_and_bad_override_rejected():
    assert config.apply_overrides({}, ["name=dcnv2"]) == {"name": "dcnv2"}
    with pytest.raises(ConfigError, match="not of the form"):
        config.apply_overrides({}, ["name"])


def test_toml_syntax_error_names_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("a = [1,\n")
    with pytest.raises(ConfigError, match="bad.toml"):
        config.read_toml(path)


def test_load_names_the_preset_or_the_overrides(tmp_path):
    preset = tmp_path / "preset.toml"
    preset.write_text("rate = 0.5\n[inner]\nwidth = 2\n")
    assert config.load(Outer, preset, ["inner.kind=b"]) == Outer(
        rate=0.5, inner=Inner(width=2, kind="b")
    )
    with pytest.raises(
        ConfigError, match=r"preset.toml with overrides: unknown config key inner\.wdth"
    ):
        config.load(Outer, preset, ["inner.wdth=3"])
    preset.write_text("rat = 0.5\n")
    with pytest.raises(ConfigError, match=r"preset.toml: unknown config key rat "):
        config.load(Outer, preset, ["inner.width=3"])
