"""The one config system: frozen dataclasses, TOML presets, command-line overrides.

Every config in hybridrec is a frozen, keyword-only dataclass that validates
itself in `__post_init__`. This module turns nested dicts (from a TOML preset and
`section.key=value` overrides) into those dataclasses, and refuses any key the
dataclass does not declare: a misspelled key is an error naming its full dotted
path, never silently ignored.

Example:
    from hybridrec.training.config import PRESET_DIR, TrainConfig
    config = load(TrainConfig, preset="criteo_dlrm", overrides=["model.tower=dcnv2"],
                  preset_dir=PRESET_DIR)

A preset given by name is looked up in `preset_dir` (here the built-in presets,
training/configs/); without `preset_dir`, `preset` must be the path of a TOML file.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from hybridrec.common.errors import ConfigError

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Converts a TOML/JSON value to the annotated type `tp`, or raises ConfigError."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in args:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(
            errors[0]
            if len(errors) == 1
            else f"{where}: {value!r} matches none of {_type_name(tp)}"
        )
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(
                f"{where}: {value!r} is not one of {', '.join(repr(a) for a in args)}"
            )
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, where=where)
    if origin in (tuple, list, Sequence) or tp in (tuple, list):
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            items = [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
        elif origin is tuple and args:
            if len(args) != len(value):
                raise ConfigError(f"{where}: expected {len(args)} items, got {len(value)}")
            items = [
                _coerce(v, a, f"{where}[{i}]")
                for i, (v, a) in enumerate(zip(value, args, strict=True))
            ]
        else:
            inner = args[0] if args else Any
            items = [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or tp is tuple else list(items)
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a table, got {value!r}")
        key_type, value_type = args or (Any, Any)
        return {
            _coerce(k, key_type, f"{where}.{k}"): _coerce(v, value_type, f"{where}.{k}")
            for k, v in value.items()
        }
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{where}: cannot read {value!r} as {_type_name(tp)}")


def from_dict(cls: type[T], data: Mapping[str, Any], *, where: str = "") -> T:
    """Builds dataclass `cls` from a nested mapping; unknown keys are errors.

    Args:
        cls: a dataclass type; nested dataclass fields are built recursively.
        data: the values, e.g. a parsed TOML table.
        where: dotted path of `data` inside the whole config, used in messages.

    Raises:
        ConfigError: unknown key (with the closest valid names), a missing required key,
            wrong type, or a value the dataclass' own validation rejects.
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    prefix = f"{where}." if where else ""
    unknown = [key for key in data if key not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, list(fields), n=1)
        hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
        raise ConfigError(
            f"unknown config key {prefix}{key}{hint}; {cls.__name__} accepts: {', '.join(sorted(fields))}"
        )
    missing = [
        f"{prefix}{name}"
        for name, field in fields.items()
        if name not in data
        and field.default is dataclasses.MISSING
        and field.default_factory is dataclasses.MISSING
    ]
    if missing:  # the constructor would name only an argument of itself
        plural = "s" * (len(missing) > 1)
        raise ConfigError(f"missing required key{plural} {', '.join(missing)}")
    kwargs = {key: _coerce(value, hints[key], f"{prefix}{key}") for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{where or cls.__name__}: {error}") from None


def to_dict(config: Any) -> Any:
    """The inverse of `from_dict`: nested plain dicts/lists, ready for TOML or JSON."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, list | tuple):
        return [to_dict(v) for v in config]
    if isinstance(config, Mapping):
        return {k: to_dict(v) for k, v in config.items()}
    return config


def read_toml(path: str | Path) -> dict[str, Any]:
    """Reads a TOML file; syntax errors name the file and line."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: {error}") from None


def _parse_override_value(text: str) -> Any:
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word such as dcnv2 reads as a string


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Returns a copy of `data` with `a.b.c=value` overrides applied.

    Values are TOML literals (`3`, `1e-3`, `true`, `[512, 256]`, `"text"`); a bare
    word that is not a TOML literal is taken as a string.
    """
    result = _deep_copy(data)
    for override in overrides:
        key, sep, text = override.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {override!r} is not of the form section.key=value")
        node = result
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {override!r}: {part} is a value, not a section")
            node = child
        node[parts[-1]] = _parse_override_value(text.strip())
    return result


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def resolve_preset(preset: str | Path, preset_dir: Path | None = None) -> Path:
    """A preset is a path to a TOML file or the name of a `.toml` file in `preset_dir`."""
    path = Path(preset)
    if path.suffix == ".toml" or path.exists() or preset_dir is None:
        return path
    builtin = preset_dir / f"{preset}.toml"
    if builtin.exists():
        return builtin
    names = sorted(p.stem for p in preset_dir.glob("*.toml"))
    raise ConfigError(f"unknown preset {preset!r}: not a file and not one of {', '.join(names)}")


def load(
    cls: type[T],
    preset: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    preset_dir: Path | None = None,
) -> T:
    """Loads config `cls` from an optional preset plus `key=value` overrides.

    `preset` is a TOML file or the name of one in `preset_dir`.
    """
    data: dict[str, Any] = {}
    if preset is not None:
        path = resolve_preset(preset, preset_dir)
        data = read_toml(path)
        try:
            return from_dict(cls, apply_overrides(data, overrides))
        except ConfigError as error:
            # Name the source of the mistake: the preset file, or the overrides on top of it.
            source = f"{path} with overrides" if overrides and _loads(cls, data) else str(path)
            raise ConfigError(f"{source}: {error}") from None
    return from_dict(cls, apply_overrides(data, overrides))


def _loads(cls: type, data: Mapping[str, Any]) -> bool:
    try:
        from_dict(cls, data)
    except ConfigError:
        return False
    return True
