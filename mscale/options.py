"""The configuration machinery every room uses, a leaf (it imports no room): `opt()` declares
a key, `ConfigError` says which key is wrong and where, `parse_bool` is the one boolean parser
(environment variables, CLI flags; the training job's too), and `build` makes a section from
its TOML table strictly. The agent's whole config is assembled from the rooms' sections in
mscale.daemon.config, above them; a room imports only this module.

A section is a frozen dataclass of `opt()` fields declaring its own table's help as
`HELP: ClassVar[str]`; it may define `check(self, key)` for rules across its fields.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import field
from pathlib import Path
from typing import Any

DEFAULT_PATH = Path("/etc/mscale/agent.toml")
ENV_PREFIX = "MSCALE_"


class ConfigError(ValueError):
    """A configuration value is wrong. The message names the key and what was expected."""


def opt(
    default: Any,
    help: str,
    *,
    min: float | None = None,
    max: float | None = None,
    choices: tuple | None = None,
    factory: Any = None,
) -> Any:
    meta = {"help": help, "min": min, "max": max, "choices": choices}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def parse_bool(value: str) -> bool:
    """The one boolean parser for environment variables and CLI flags."""
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (true/false, yes/no, on/off, 1/0), got {value!r}")


def fields_of(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    """(field, type) of a section class; tables of `Config` resolve their room's class now."""
    hints: dict[str, Any] | None = None
    out = []
    for f in dataclasses.fields(cls):
        resolve = f.metadata.get("section")
        if resolve is not None:
            out.append((f, resolve()))
            continue
        if hints is None:
            hints = typing.get_type_hints(cls)
        out.append((f, hints[f.name]))
    return out


_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(?:#.*)?$")
_KEY = re.compile(r"""^\s*((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*=""")


def _dotted(raw: str) -> str:
    """`a . "b" . c` -> `a.b.c` (a TOML key or table name, quotes and spaces dropped)."""
    parts = re.findall(r"""[A-Za-z0-9_-]+|"[^"]*"|'[^']*'""", raw)
    return ".".join(p.strip("\"'") for p in parts)


def line_of(text: str | None, dotted: str) -> str:
    """' (line N)': where `dotted` is set (or its table opens) in the TOML `text`, tracking
    the table each line is in; a key set inside an inline table points at that table."""
    if not text:
        return ""
    table, best, best_len = "", 0, -1
    for no, line in enumerate(text.split("\n"), 1):
        header = _HEADER.match(line)
        if header:
            table = _dotted(header.group(1))
            full = table
        else:
            key = _KEY.match(line)
            if not key:
                continue
            full = f"{table}.{_dotted(key.group(1))}" if table else _dotted(key.group(1))
        if full == dotted:
            return f" (line {no})"
        if dotted.startswith(full + ".") and len(full) > best_len:
            best, best_len = no, len(full)
    return f" (line {best})" if best else ""


def _type_name(tp: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}.get(tp, str(tp))


def _coerce(dotted: str, tp: Any, value: Any, meta: dict, text: str | None) -> Any:
    where = line_of(text, dotted)
    if typing.get_origin(tp) is list:  # list[X]: each item an X, min/max/choices apply per item
        if not isinstance(value, list):
            raise ConfigError(f"{dotted}{where}: expected a list, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(tp)
        out = []
        for i, v in enumerate(value):
            try:
                out.append(_coerce(dotted, item, v, meta, None))
            except ConfigError as e:
                raise ConfigError(f"{dotted}{where}: item {i}: {str(e).removeprefix(dotted + ': ')}") from None
        return out
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, tp) and not (tp in (int, float) and isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{dotted}{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if tp is float and not math.isfinite(value):  # nan passes every range check; inf is no setting
        raise ConfigError(f"{dotted}{where}: expected a finite number, got {value!r}")
    if meta.get("choices") and value not in meta["choices"]:
        raise ConfigError(f"{dotted}{where}: expected one of {', '.join(map(str, meta['choices']))}, got {value!r}")
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and value < lo or hi is not None and value > hi:
        rng = (
            f"between {lo} and {hi}"
            if lo is not None and hi is not None
            else (f">= {lo}" if lo is not None else f"<= {hi}")
        )
        raise ConfigError(f"{dotted}{where}: expected a value {rng}, got {value!r}")
    return value


def build(cls: type, data: dict, prefix: str, text: str | None) -> Any:
    fields = {f.name: (f, tp) for f, tp in fields_of(cls)}
    for key in data:
        if key not in fields:
            dotted = f"{prefix}{key}"
            known = ", ".join(sorted(fields))
            raise ConfigError(
                f"{dotted}{line_of(text, dotted)}: unknown key (known in [{prefix.rstrip('.') or 'top level'}]: {known})"
            )
    kwargs = {}
    for name, (f, tp) in fields.items():
        if name not in data:
            continue
        dotted = f"{prefix}{name}"
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if not isinstance(data[name], dict):
                raise ConfigError(f"{dotted}{line_of(text, dotted)}: expected a table [{dotted}]")
            kwargs[name] = build(tp, data[name], dotted + ".", text)
        else:
            kwargs[name] = _coerce(dotted, tp, data[name], dict(f.metadata), text)
    return cls(**kwargs)


def check_all(section: Any, key: str) -> None:
    """Run each section's `check(key)` (rules across fields), tables in file order."""
    check = getattr(section, "check", None)
    if check is not None:
        check(key)
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            check_all(value, f"{key}.{f.name}" if key else f.name)
