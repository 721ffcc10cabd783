"""The agent's configuration: one TOML file, strict, documented from the field metadata.

`Config` is assembled here from the sections the rooms declare (each a frozen dataclass of
`opt()` keys in the room's own settings module, with its table's help as `HELP`); this module
of the agent's room imports them, and no other room imports it: the machinery they use
(`opt`, `ConfigError`, `parse_bool`, the strict builder) is the leaf mscale.options.

  [agent] [socket] [webhook] [http] [chaos]  mscale.daemon.settings
  [probes.<name>]             the probe's own module, carried by its `SPEC` (one line in
                              mscale.probes.REGISTRY); `enabled` defaults to the spec's
                              `default_enabled`
  [health]                    mscale.probes.gpu_health
  [healing]                   mscale.healing.settings
  [contract]                  mscale.contracts.settings
  [stragglers]                mscale.daemon.settings (mscale.daemon.stragglers)
  [kubernetes]                mscale.kube.settings
  [remediation]               mscale.kube.remediation.settings, [remediation.<filer>] from
                              each filer's module (mscale.kube.remediation.REGISTRY)

`from_dict`/`load` build a `Config` strictly, `reference_markdown()` renders
docs/configuration.md's table. Every key has a default, a type and (where it matters) a range;
a test keeps docs/configuration.md in step. Unknown keys, wrong types and out-of-range values
raise `ConfigError` naming the key (and its line). A section may define `check(self, key)` for
rules across its fields.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mscale import probes
from mscale.contracts.settings import ContractSection
from mscale.daemon.settings import (
    AgentSection,
    ChaosSection,
    HttpSection,
    SocketSection,
    StragglerSection,
    WebhookSection,
)
from mscale.healing.settings import HealingSection
from mscale.kube.remediation.settings import RemediationSection
from mscale.kube.remediation.settings import section as remediation_section
from mscale.kube.settings import KubernetesSection
from mscale.options import (
    DEFAULT_PATH,
    ENV_PREFIX,
    ConfigError,
    build,
    check_all,
    fields_of,
    line_of,
    opt,
    parse_bool,
)
from mscale.probes.gpu_health import HealthSection
from mscale.textfile import read_text

__all__ = ["Config", "ConfigError", "DEFAULT_PATH", "from_dict", "load", "locate", "opt", "parse_bool"]

# --- assembly ----------------------------------------------------------------------------


def _table(cls: type) -> Any:
    """A table of `Config`: the room's section class, with the help it declares (`HELP`)."""
    return _section(lambda: cls, cls.HELP)  # type: ignore[attr-defined]  # each section declares HELP


def _section(resolve: Callable[[], type], help: str) -> Any:
    """A table of `Config` whose class is found when a config is made (the probes' table
    holds whatever probes are registered then)."""
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
    spec = probes.spec(name)
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
    return _probes_table(tuple(probes.REGISTRY.items()))


@dataclass(frozen=True)
class Config:
    agent: AgentSection = _table(AgentSection)
    probes: ProbesSection = _section(probes_section, "probes")
    health: HealthSection = _table(HealthSection)
    socket: SocketSection = _table(SocketSection)
    webhook: WebhookSection = _table(WebhookSection)
    http: HttpSection = _table(HttpSection)
    chaos: ChaosSection = _table(ChaosSection)
    healing: HealingSection = _table(HealingSection)
    contract: ContractSection = _table(ContractSection)
    stragglers: StragglerSection = _table(StragglerSection)
    kubernetes: KubernetesSection = _table(KubernetesSection)
    remediation: RemediationSection = _section(remediation_section, RemediationSection.HELP)

    def replace(self, **sections: Any) -> Config:
        return dataclasses.replace(self, **sections)


# --- loading -----------------------------------------------------------------------------


def locate(path: str | os.PathLike[str], dotted: str) -> str:
    """'FILE: KEY (line N)' for a key read from the config at `path` (for errors found after
    loading, e.g. the listen address); just the key when the file cannot be read again."""
    try:
        text = read_text(path, ConfigError, "config")
    except ConfigError:
        return dotted
    return f"{path}: {dotted}{line_of(text, dotted)}"


def from_dict(data: dict[str, Any], *, text: str | None = None) -> Config:
    cfg = build(Config, data, "", text)
    try:
        check_all(cfg, "")
    except ConfigError as e:  # a rule across fields names its key: add the key's line
        key, sep, rest = str(e).partition(": ")
        where = line_of(text, key.split("[", 1)[0]) if sep and "(line " not in key else ""
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


def load(path: str | os.PathLike[str] | None) -> Config:
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
    except ValueError:  # an integer of more than 4300 digits: Python will not convert it
        if m := re.search(r"[0-9_]{4301,}", text):
            line = text.count("\n", 0, m.start()) + 1
            raise ConfigError(
                f"{p}: line {line}: a number of {len(m.group())} digits: no setting takes one (at most 4300)"
            ) from None
        raise ConfigError(f"{p}: not valid TOML: a number too long to convert") from None
    try:
        return from_dict(data, text=text)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


def reference_markdown() -> str:
    """The key table of docs/configuration.md, generated from the field metadata."""
    rows = ["| key | default | meaning |", "|---|---|---|"]

    def walk(cls: type, prefix: str) -> None:
        inst = cls()
        for f, tp in fields_of(cls):
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
