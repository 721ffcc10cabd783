"""Agent configuration: one TOML file, strict, documented from the field metadata.

This module is the machinery only: `opt()` declares a key, `from_dict`/`load` build a
`Config` strictly, `reference_markdown()` renders docs/configuration.md's table. The sections belong
to the rooms that read them, and are imported only when a config is assembled (never when
this module is), so every room may import `opt` from here without a cycle:

  [agent] [socket] [webhook]  mscale.daemon.settings
  [probes.<name>]             the probe's own module, carried by its `SPEC` (one line in
                              mscale.probes.REGISTRY); `enabled` defaults to the spec's
                              `default_enabled`
  [health]                    mscale.probes.gpu_health
  [healing]                   mscale.healing.settings
  [contract]                  mscale.contracts.settings
  [kubernetes]                mscale.kube.settings

Every key has a default, a type and (where it matters) a range; a test keeps
docs/configuration.md in step. Unknown keys, wrong types and out-of-range values raise `ConfigError` naming
the key (and its line). A section may define `check(self, key)` for rules across its fields.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import os
import re
import tomllib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mscale.textfile import read_text

if TYPE_CHECKING:
    from mscale.contracts.settings import ContractSection
    from mscale.daemon.settings import AgentSection, ChaosSection, HttpSection, SocketSection, WebhookSection
    from mscale.daemon.stragglers import StragglerSection
    from mscale.healing.settings import HealingSection
    from mscale.kube.settings import KubernetesSection
    from mscale.probes.gpu_health import HealthSection

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


# --- assembly ----------------------------------------------------------------------------


def _import(dotted: str) -> Any:
    """'package.module:Name' -> the object, imported now."""
    module, _, name = dotted.partition(":")
    return getattr(importlib.import_module(module), name)


def _section(where: str | Callable[[], type], help: str) -> Any:
    """A table of `Config`: the room's class (a dotted name, or a function building it),
    resolved when a config is made, never when this module is imported."""
    resolve: Callable[[], type] = where if callable(where) else functools.partial(_import, where)
    meta = {"help": help, "min": None, "max": None, "choices": None, "section": resolve}
    return field(default_factory=lambda: resolve()(), metadata=meta)


class ProbesSection:
    """[probes]: one table per probe in mscale.probes.REGISTRY, each the probe's own section
    class with `enabled` in front (default: the spec's `default_enabled`). Read a probe's
    table as `cfg.probes.<name>`; its type is the probe module's section class."""

    if TYPE_CHECKING:

        def __getattr__(self, name: str) -> Any: ...


@functools.cache
def _probe_table(name: str, module: str) -> type:
    spec = importlib.import_module(module).SPEC
    section = spec.section
    enabled = dataclasses.make_dataclass(
        f"_{section.__name__}Enabled",
        [("enabled", bool, opt(spec.default_enabled, spec.enabled_help or f"run the {name} probe"))],
        frozen=True,
    )
    # The last base's fields come first: `enabled`, then the probe's own keys in order.
    cls = dataclasses.make_dataclass(section.__name__, [], bases=(section, enabled), frozen=True)
    cls.__module__ = enabled.__module__ = section.__module__
    return cls


@functools.cache
def _probes_table(registry: tuple[tuple[str, str], ...]) -> type:
    tables = [(name, _probe_table(name, module)) for name, module in registry]
    cls = dataclasses.make_dataclass(
        "ProbesSection",
        [(name, t, opt(None, f"the {name} probe", factory=t)) for name, t in tables],
        bases=(ProbesSection,),
        frozen=True,
    )
    cls.__module__ = __name__
    return cls


def probes_section() -> type:
    """The [probes] class for the probes registered now (mscale.probes.REGISTRY)."""
    registry: dict[str, str] = importlib.import_module("mscale.probes").REGISTRY
    return _probes_table(tuple(registry.items()))


@dataclass(frozen=True)
class Config:
    agent: AgentSection = _section("mscale.daemon.settings:AgentSection", "the agent process")
    probes: ProbesSection = _section(probes_section, "probes")
    health: HealthSection = _section("mscale.probes.gpu_health:HealthSection", "GPU health thresholds")
    socket: SocketSection = _section("mscale.daemon.settings:SocketSection", "the hook library's Unix socket")
    webhook: WebhookSection = _section("mscale.daemon.settings:WebhookSection", "the Alertmanager webhook")
    http: HttpSection = _section("mscale.daemon.settings:HttpSection", "HTTP timeouts, connection caps, Host names")
    chaos: ChaosSection = _section("mscale.daemon.settings:ChaosSection", "the chaos API (fault injection)")
    healing: HealingSection = _section("mscale.healing.settings:HealingSection", "the healing engine")
    contract: ContractSection = _section(
        "mscale.contracts.settings:ContractSection", "resource contracts, MSRP and the density guard"
    )
    stragglers: StragglerSection = _section(
        "mscale.daemon.stragglers:StragglerSection", "slow ranks and slow MPUs, against the job's other ranks"
    )
    kubernetes: KubernetesSection = _section("mscale.kube.settings:KubernetesSection", "running on Kubernetes")

    def replace(self, **sections: Any) -> Config:
        return dataclasses.replace(self, **sections)


def _fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
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


# --- loading -----------------------------------------------------------------------------


_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(?:#.*)?$")
_KEY = re.compile(r"""^\s*((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*=""")


def _dotted(raw: str) -> str:
    """`a . "b" . c` -> `a.b.c` (a TOML key or table name, quotes and spaces dropped)."""
    parts = re.findall(r"""[A-Za-z0-9_-]+|"[^"]*"|'[^']*'""", raw)
    return ".".join(p.strip("\"'") for p in parts)


def _line_of(text: str | None, dotted: str) -> str:
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


def locate(path: str | os.PathLike, dotted: str) -> str:
    """'FILE: KEY (line N)' for a key read from the config at `path` (for errors found after
    loading, e.g. the listen address); just the key when the file cannot be read again."""
    try:
        text = read_text(path, ConfigError, "config")
    except ConfigError:
        return dotted
    return f"{path}: {dotted}{_line_of(text, dotted)}"


def _type_name(tp: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}.get(tp, str(tp))


def _coerce(dotted: str, tp: Any, value: Any, meta: dict, text: str | None) -> Any:
    where = _line_of(text, dotted)
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


def _build(cls: type, data: dict, prefix: str, text: str | None) -> Any:
    fields = {f.name: (f, tp) for f, tp in _fields(cls)}
    for key in data:
        if key not in fields:
            dotted = f"{prefix}{key}"
            known = ", ".join(sorted(fields))
            raise ConfigError(
                f"{dotted}{_line_of(text, dotted)}: unknown key (known in [{prefix.rstrip('.') or 'top level'}]: {known})"
            )
    kwargs = {}
    for name, (f, tp) in fields.items():
        if name not in data:
            continue
        dotted = f"{prefix}{name}"
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            if not isinstance(data[name], dict):
                raise ConfigError(f"{dotted}{_line_of(text, dotted)}: expected a table [{dotted}]")
            kwargs[name] = _build(tp, data[name], dotted + ".", text)
        else:
            kwargs[name] = _coerce(dotted, tp, data[name], dict(f.metadata), text)
    return cls(**kwargs)


def _check(section: Any, key: str) -> None:
    """Run each section's `check(key)` (rules across fields), tables in file order."""
    check = getattr(section, "check", None)
    if check is not None:
        check(key)
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            _check(value, f"{key}.{f.name}" if key else f.name)


def from_dict(data: dict, *, text: str | None = None) -> Config:
    cfg = _build(Config, data, "", text)
    try:
        _check(cfg, "")
    except ConfigError as e:  # a rule across fields names its key: add the key's line
        key, sep, rest = str(e).partition(": ")
        where = _line_of(text, key.split("[", 1)[0]) if sep and "(line " not in key else ""
        raise ConfigError(f"{key}{where}{sep}{rest}") from None
    return _apply_env(cfg)


def _apply_env(cfg: Config) -> Config:
    token = os.environ.get(ENV_PREFIX + "WEBHOOK_TOKEN")
    if token and not cfg.webhook.token:
        cfg = cfg.replace(webhook=dataclasses.replace(cfg.webhook, token=token))
    chaos_token = os.environ.get(ENV_PREFIX + "CHAOS_TOKEN")
    if chaos_token and not cfg.chaos.token:
        cfg = cfg.replace(chaos=dataclasses.replace(cfg.chaos, token=chaos_token))
    return cfg


def load(path: str | os.PathLike | None) -> Config:
    """Load the file at `path`; None means the default path if it exists, else defaults."""
    if path is None:
        if not DEFAULT_PATH.exists():
            return from_dict({})
        path = DEFAULT_PATH
    p = Path(path)
    text = read_text(p, ConfigError, "config")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # tomllib says "(at line N, column M)", or "(at end of document)": name that line too
        last = f"(at end of document, line {text.count(chr(10)) + 1})"
        raise ConfigError(f"{p}: not valid TOML: {str(e).replace('(at end of document)', last)}") from None
    except RecursionError:  # arrays or inline tables nested thousands deep
        raise ConfigError(f"{p}: not valid TOML: nested too deeply") from None
    try:
        return from_dict(data, text=text)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


def parse_bool(value: str) -> bool:
    """The one boolean parser for environment variables and CLI flags."""
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (true/false, yes/no, on/off, 1/0), got {value!r}")


def reference_markdown() -> str:
    """The key table of docs/configuration.md, generated from the field metadata."""
    rows = ["| key | default | meaning |", "|---|---|---|"]

    def walk(cls: type, prefix: str) -> None:
        inst = cls()
        for f, tp in _fields(cls):
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
                continue
            default = getattr(inst, f.name)
            shown = f"`{default!r}`" if not isinstance(default, bool) else f"`{str(default).lower()}`"
            if f.name == "mode":
                shown = f"`0o{default:o}`"
            meta = f.metadata
            extra = ""
            if meta.get("choices"):
                extra = f" ({' / '.join(meta['choices'])})"
            elif meta.get("min") is not None or meta.get("max") is not None:
                extra = f" (range {meta.get('min', '')}..{meta.get('max') if meta.get('max') is not None else ''})"
            rows.append(f"| `{prefix}{f.name}` | {shown} | {meta['help']}{extra} |")

    walk(Config, "")
    return "\n".join(rows) + "\n"
