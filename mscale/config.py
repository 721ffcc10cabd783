"""Agent configuration: one TOML file, strict, documented from the field metadata.

Every key has a default, a type and (where it matters) a range; the README's table is
generated from `reference_markdown()` and a test keeps the two in step. Unknown keys,
wrong types and out-of-range values raise `ConfigError` naming the key (and its line).
"""
from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mscale.textfile import read_text

DEFAULT_PATH = Path("/etc/mscale/agent.toml")
ENV_PREFIX = "MSCALE_"


class ConfigError(ValueError):
    """A configuration value is wrong. The message names the key and what was expected."""


def opt(default: Any, help: str, *, min: float | None = None, max: float | None = None,
        choices: tuple | None = None, factory: Any = None) -> Any:
    meta = {"help": help, "min": min, "max": max, "choices": choices}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class AgentSection:
    listen: str = opt("127.0.0.1:9477", "HTTP listen address HOST:PORT for /metrics and the API (port 0 picks one)")
    socket_path: str = opt("/run/mscale/agent.sock", "Unix socket the hook library connects to")
    node: str = opt("", "node name in labels and events (empty: the host name)")
    simulate: str = opt("", "fault timeline YAML: run on simulated GPUs instead of NVML (empty: real GPUs)")
    log_level: str = opt("info", "log level", choices=("debug", "info", "warning", "error"))
    event_history: int = opt(1000, "events kept for GET /api/v1/events", min=10, max=1_000_000)
    shutdown_timeout_s: float = opt(5.0, "longest a clean shutdown may take before tasks are cancelled", min=0.1, max=120)


@dataclass(frozen=True)
class GpuProbeSection:
    enabled: bool = opt(True, "run the GPU probe")
    interval_s: float = opt(1.0, "seconds between GPU samples", min=0.05, max=3600)
    timeout_s: float = opt(5.0, "deadline for one sample; past it the probe is down", min=0.05, max=600)
    backend: str = opt("nvml", "where GPU data comes from: nvml, or dcgm (a dcgm-exporter endpoint)", choices=("nvml", "dcgm"))
    dcgm_url: str = opt("http://127.0.0.1:9400/metrics", "dcgm-exporter endpoint, for backend = dcgm")


@dataclass(frozen=True)
class HostProbeSection:
    enabled: bool = opt(True, "run the host probe")
    interval_s: float = opt(5.0, "seconds between host samples", min=0.05, max=3600)
    timeout_s: float = opt(5.0, "deadline for one sample", min=0.05, max=600)
    proc_root: str = opt("/proc", "procfs root (tests point it at a fixture tree)")


@dataclass(frozen=True)
class EbpfProbeSection:
    enabled: bool = opt(True, "run the eBPF CUDA-driver probe (needs BCC and CAP_BPF/CAP_PERFMON)")
    interval_s: float = opt(1.0, "seconds between reads of the BPF maps", min=0.05, max=3600)
    timeout_s: float = opt(30.0, "deadline for one read (the first includes compiling the BPF program)", min=0.05, max=600)
    libcuda_path: str = opt("", "path of libcuda.so.1 (empty: found per process from /proc/PID/maps)")
    cmdline_pattern: str = opt("", "regex: also trace processes whose command line matches (empty: registered jobs only)")
    hang_timeout_s: float = opt(60.0, "no kernel launch, or one sync call blocked, for this long is a hang", min=0.1, max=86400)
    sync_stall_ratio: float = opt(0.5, "share of wall time blocked in synchronise calls that is a sync stall", min=0.01, max=1.0)
    sync_stall_window_s: float = opt(30.0, "window over which the sync-stall share is measured", min=0.5, max=3600)
    duty_window_s: float = opt(0.5, "high-rate probes (launch, copy) stay attached this long ...", min=0.01, max=3600)
    duty_period_s: float = opt(10.0, "... once every this many seconds (equal to the window: always on)", min=0.01, max=3600)
    max_processes: int = opt(256, "processes traced at once (sizes the BPF maps)", min=1, max=65536)
    attach_mode: str = opt("auto", "how uprobes are attached: uprobe_multi links (Linux 6.6+, fast to detach), "
                           "perf_event (one per symbol), or auto (the first that works)",
                           choices=("auto", "uprobe_multi", "perf_event"))


@dataclass(frozen=True)
class ProbesSection:
    gpu: GpuProbeSection = opt(None, "GPU probe", factory=GpuProbeSection)
    host: HostProbeSection = opt(None, "host probe", factory=HostProbeSection)
    ebpf: EbpfProbeSection = opt(None, "eBPF probe", factory=EbpfProbeSection)


@dataclass(frozen=True)
class HealthSection:
    temperature_degraded_c: float = opt(83.0, "GPU temperature at or above this is degraded", min=0, max=200)
    sbe_per_hour_degraded: float = opt(100.0, "single-bit ECC errors per hour above this is degraded", min=0)
    pcie_replays_per_min_degraded: float = opt(100.0, "PCIe replays per minute above this (a replay storm) is degraded", min=0)
    xid_table: str = opt("", "CSV of Xid code, class (fatal|degrading|info), description (empty: the shipped table)")
    rate_window_s: float = opt(300.0, "window over which the single-bit ECC and PCIe replay rates are measured", min=60, max=86400)
    xid_degraded_hold_s: float = opt(3600.0, "a degrading Xid keeps its GPU degraded this long after it last occurred (or until a GPU reset)", min=0, max=30 * 86400)


@dataclass(frozen=True)
class SocketSection:
    allowed_uids: list = opt(None, "extra user ids allowed on the socket besides the agent's own and root", factory=list)
    max_message_bytes: int = opt(1 << 20, "larger messages on the socket are refused and counted", min=1024, max=1 << 30)
    mode: int = opt(0o660, "file mode of the socket", min=0, max=0o777)


@dataclass(frozen=True)
class WebhookSection:
    token: str = opt("", "bearer token Alertmanager must send (or env MSCALE_WEBHOOK_TOKEN); empty refuses every call")
    max_body_bytes: int = opt(1 << 20, "larger webhook bodies are refused", min=1024, max=1 << 30)
    max_actions_per_minute: int = opt(30, "rate limit on actions triggered by alerts", min=1, max=100000)


@dataclass(frozen=True)
class HealingSection:
    enabled: bool = opt(True, "let the healing engine act (false: detect and report only)")
    checksum_failures_l1: int = opt(3, "consecutive checksum failures of an MPU that trigger an L1 swap", min=1, max=1000)
    max_swaps_per_hour: int = opt(4, "L1 swaps of one MPU per hour before escalating to L2", min=1, max=1000)
    recovery_clean_steps: int = opt(50, "clean steps an MPU needs before it counts as recovered", min=1, max=1_000_000)
    lr_cool_factor: float = opt(0.1, "LR multiplier during a loss-spike cooling window", min=1e-6, max=1.0)
    lr_cool_steps: int = opt(20, "length of the cooling window in steps", min=1, max=1_000_000)
    distill_weight_min: float = opt(0.15, "lower bound of the L3 distillation share of the loss", min=0.0, max=1.0)
    distill_weight_max: float = opt(0.30, "upper bound of the L3 distillation share of the loss", min=0.0, max=1.0)
    policy: str = opt("", "healing policy YAML (empty: the shipped default policy)")
    l2_precision_fallback: bool = opt(False, "L2 on a CPU MPU also runs its forward in bf16; trades checksum sensitivity "
                                      "(bf16 tolerance 1e-2 vs 2e-6 in fp32: corruption below it goes unseen while "
                                      "degraded, so L3 may not engage). An MPU on a GPU moves to the CPU regardless")


@dataclass(frozen=True)
class Config:
    agent: AgentSection = opt(None, "the agent process", factory=AgentSection)
    probes: ProbesSection = opt(None, "probes", factory=ProbesSection)
    health: HealthSection = opt(None, "GPU health thresholds", factory=HealthSection)
    socket: SocketSection = opt(None, "the hook library's Unix socket", factory=SocketSection)
    webhook: WebhookSection = opt(None, "the Alertmanager webhook", factory=WebhookSection)
    healing: HealingSection = opt(None, "the healing engine", factory=HealingSection)

    def replace(self, **sections: Any) -> "Config":
        return dataclasses.replace(self, **sections)


# --- loading -----------------------------------------------------------------------------

def _line_of(text: str | None, dotted: str) -> str:
    if not text:
        return ""
    leaf = dotted.rsplit(".", 1)[-1]
    for no, line in enumerate(text.splitlines(), 1):
        if re.match(rf"\s*{re.escape(leaf)}\s*=", line) or re.match(rf"\s*\[\s*{re.escape(dotted)}\s*\]", line):
            return f" (line {no})"
    return ""


def _type_name(tp: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}.get(tp, str(tp))


def _coerce(dotted: str, tp: Any, value: Any, meta: dict, text: str | None) -> Any:
    where = _line_of(text, dotted)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, tp) and not (tp in (int, float) and isinstance(value, bool))
    if not ok:
        raise ConfigError(f"{dotted}{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    if meta.get("choices") and value not in meta["choices"]:
        raise ConfigError(f"{dotted}{where}: expected one of {', '.join(map(str, meta['choices']))}, got {value!r}")
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and value < lo or hi is not None and value > hi:
        rng = f"between {lo} and {hi}" if lo is not None and hi is not None else (f">= {lo}" if lo is not None else f"<= {hi}")
        raise ConfigError(f"{dotted}{where}: expected a value {rng}, got {value!r}")
    return value


def _build(cls: type, data: dict, prefix: str, text: str | None) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            dotted = f"{prefix}{key}"
            known = ", ".join(sorted(fields))
            raise ConfigError(f"{dotted}{_line_of(text, dotted)}: unknown key (known in [{prefix.rstrip('.') or 'top level'}]: {known})")
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            continue
        tp = hints[name]
        dotted = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            if not isinstance(data[name], dict):
                raise ConfigError(f"{dotted}{_line_of(text, dotted)}: expected a table [{dotted}]")
            kwargs[name] = _build(tp, data[name], dotted + ".", text)
        else:
            kwargs[name] = _coerce(dotted, tp, data[name], dict(f.metadata), text)
    return cls(**kwargs)


def from_dict(data: dict, *, text: str | None = None) -> Config:
    cfg = _build(Config, data, "", text)
    h = cfg.healing
    if h.distill_weight_min > h.distill_weight_max:
        raise ConfigError("healing.distill_weight_min: expected at most healing.distill_weight_max "
                          f"({h.distill_weight_max}), got {h.distill_weight_min}")
    return _apply_env(cfg)


def _apply_env(cfg: Config) -> Config:
    token = os.environ.get(ENV_PREFIX + "WEBHOOK_TOKEN")
    if token and not cfg.webhook.token:
        cfg = cfg.replace(webhook=dataclasses.replace(cfg.webhook, token=token))
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
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
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
    """The README's configuration table, generated from the field metadata."""
    rows = ["| key | default | meaning |", "|---|---|---|"]

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        inst = cls()
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
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
