"""Config dataclasses from flags and environment, built once in `main()`.

Every service describes its settings as frozen dataclasses whose fields carry
`metadata={"help": ...}`. `add_arguments` turns a dataclass into argparse flags
(`--field-name`), and `build` makes the instance: a flag given on the command
line wins, then the environment variable `PDMESH_FIELD_NAME`, then the field's
default. Validation lives in each dataclass's `__post_init__`, so a bad value is
refused once, at start, with the field named. Nothing deeper reads os.environ.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")

ENV_PREFIX = "PDMESH_"


class ConfigError(ValueError):
    """A setting has an invalid value."""


def setting(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with help text (used for flags and the config reference)."""
    return dataclasses.field(default=default, metadata={"help": help, **kwargs})


def flag_name(field_name: str, prefix: str = "") -> str:
    return "--" + (prefix + field_name).replace("_", "-")


def env_name(field_name: str, prefix: str = "") -> str:
    return ENV_PREFIX + (prefix + field_name).upper()


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _parse(value: str, typ: Any, name: str) -> Any:
    origin = typing.get_origin(typ)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value == "" or value.lower() == "none":
            return None
        return _parse(value, args[0], name)
    if origin is tuple:
        (item,) = {a for a in typing.get_args(typ) if a is not Ellipsis}
        return tuple(_parse(v.strip(), item, name) for v in value.split(",") if v.strip())
    if typ is bool:
        low = value.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}: expected a boolean, got {value!r}")
    try:
        return typ(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{name}: expected {getattr(typ, '__name__', typ)}, got {value!r}") from e


def add_arguments(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """Add one flag per field of dataclass `cls` (default None = not given)."""
    types = _field_types(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        help_text = f.metadata.get("help", "")
        default = f.default if f.default is not dataclasses.MISSING else None
        parser.add_argument(
            flag_name(f.name, prefix),
            dest=prefix + f.name,
            default=None,
            type=str,
            metavar=getattr(types[f.name], "__name__", "VALUE").upper(),
            help=f"{help_text} (env {env_name(f.name, prefix)}, default {default!r})",
        )


def build(
    cls: type[T],
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    prefix: str = "",
    **overrides: Any,
) -> T:
    """Make a `cls` from overrides, then flags, then environment, then defaults."""
    types = _field_types(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in overrides:
            values[f.name] = overrides[f.name]
            continue
        raw = getattr(args, prefix + f.name, None) if args is not None else None
        source = flag_name(f.name, prefix)
        if raw is None and env is not None:
            raw = env.get(env_name(f.name, prefix))
            source = env_name(f.name, prefix)
        if raw is not None:
            values[f.name] = _parse(raw, types[f.name], source)
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{cls.__name__}: {e}") from e


def reference(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(flag, env var, default, help) rows for the configuration reference."""
    rows = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        rows.append(
            (flag_name(f.name, prefix), env_name(f.name, prefix), repr(default), f.metadata.get("help", ""))
        )
    return rows


def require(cond: bool, message: str) -> None:
    """Validation helper for `__post_init__`."""
    if not cond:
        raise ConfigError(message)
