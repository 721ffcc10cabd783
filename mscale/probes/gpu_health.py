"""GPU health: healthy, degraded or failed, with the reasons, from one GPU's readings.

Rules (thresholds from the [health] config section):
  failed   - the GPU is lost (fallen off the bus); any double-bit ECC error since the last
             reset; row remapping failed; a fatal Xid since the last reset.
  degraded - temperature at or above health.temperature_degraded_c; single-bit ECC rate
             above health.sbe_per_hour_degraded; PCIe replays above
             health.pcie_replays_per_min_degraded; an NVLink link that was up is down; a
             row remap or page retirement pending (reset needed); a degrading Xid.
The Xid classes come from a validated data file (xid_table.csv, or health.xid_table).
Readers (NVML, dcgm-exporter) feed the same model, so both backends judge alike.
"""

from __future__ import annotations

import functools
import re
from collections import deque
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

from mscale.findings import Reason
from mscale.options import opt
from mscale.probes import catalogue
from mscale.textfile import read_text

HEALTHY, DEGRADED, FAILED = "healthy", "degraded", "failed"
STATES: tuple[str, ...] = (HEALTHY, DEGRADED, FAILED)
_RANK = {HEALTHY: 0, DEGRADED: 1, FAILED: 2}
XID_CLASSES = ("fatal", "degrading", "info")
_CLASS_STATE = {"fatal": FAILED, "degrading": DEGRADED}
# NVIDIA's "Resolution Bucket (Immediate Action)" per Xid, and what the agent does for each
# (docs/xid.md): RESET_GPU and RESTART_BM fail the GPU until it resets (the healing policy
# swaps its MPUs off and quarantines it; RESTART_BM also tells the operator to drain the
# node), RESTART_APP leaves the GPU healthy and asks the job to recover in-process, IGNORE
# only counts. CONTACT_SUPPORT and the catalogue's WORKFLOW_* buckets keep the row's class.
XID_ACTIONS = ("RESTART_APP", "RESET_GPU", "RESTART_BM", "IGNORE", "CONTACT_SUPPORT")
# the class an action implies; the others accept any class
_ACTION_CLASS = {"RESET_GPU": "fatal", "RESTART_BM": "fatal", "RESTART_APP": "info", "IGNORE": "info"}
# an Xid the table does not list: degrading, with this action label (bounded, documented)
XID_UNLISTED = "UNLISTED"
# a 3-column table (no action column): the action each class stands for
_LEGACY_ACTION = {"fatal": "RESET_GPU", "degrading": "CONTACT_SUPPORT", "info": "IGNORE"}
_WORKFLOW = re.compile(r"WORKFLOW_[A-Z0-9_]{1,40}")
_APPLIES_TO = re.compile(r"[A-Za-z0-9 +<>=/.-]{0,60}")
_HEADER_V1 = ["code", "class", "description"]
_HEADER_V2 = ["code", "class", "action", "applies_to", "description"]
# Xid 154 names the recovery action the driver now requires (NVML's values); what it stands
# for, as an immediate action and class (docs/xid.md). Drain P2P has no catalogue bucket of its
# own: contact support, degraded.
XID_RECOVERY_ACTION_CHANGED = 154
RECOVERY_XID_ACTION: dict[int, tuple[str, str, str]] = {  # value -> (name, action, class)
    0: ("none", "IGNORE", "info"),
    1: ("gpu_reset", "RESET_GPU", "fatal"),
    2: ("node_reboot", "RESTART_BM", "fatal"),
    3: ("drain_p2p", "CONTACT_SUPPORT", "degrading"),
    4: ("drain_and_reset", "RESET_GPU", "fatal"),
}
_RECOVERY_BY_TEXT = {"none": 0, "gpu reset required": 1, "node reboot required": 2, "os reboot": 2}
_RECOVERY_BY_TEXT |= {"drain p2p": 3, "drain and reset": 4}
_XID154_TEXT = re.compile(r"recovery action changed from .*? to (0x[0-9a-fA-F]{1,8})\s*(?:\(([^)]{0,60})\))?")


def parse_recovery_action(message: str) -> int | None:
    """The new action of an Xid 154 line ('... changed from 0x0 (None) to 0x2 (Node Reboot
    Required)'): by its number, else by its name; None when the text names none we know."""
    m = _XID154_TEXT.search(message[:1000])
    if m is None:
        return None
    value = int(m.group(1), 16)
    if value in RECOVERY_XID_ACTION:
        return value
    return _RECOVERY_BY_TEXT.get((m.group(2) or "").strip().lower())


# Rates over a shorter span are computed as if this much time had passed, so one early
# error after start-up is not a storm.
MIN_RATE_SPAN_S = 60.0


@dataclass(frozen=True)
class HealthSection:
    """[health]: the thresholds of the model below (both GPU backends judge by them)."""

    HELP: ClassVar[str] = "GPU health thresholds"

    temperature_degraded_c: float = opt(83.0, "GPU temperature at or above this is degraded", min=0, max=200)
    sbe_per_hour_degraded: float = opt(100.0, "single-bit ECC errors per hour above this is degraded", min=0)
    pcie_replays_per_min_degraded: float = opt(
        100.0, "PCIe replays per minute above this (a replay storm) is degraded", min=0
    )
    xid_table: str = opt(
        "", "CSV of Xid code, class, NVIDIA action, applies_to, description (docs/xid.md; empty: the shipped table)"
    )
    rate_window_s: float = opt(
        300.0, "window over which the single-bit ECC and PCIe replay rates are measured", min=60, max=86400
    )
    xid_degraded_hold_s: float = opt(
        3600.0,
        "a degrading Xid keeps its GPU degraded this long after it last occurred (or until a GPU reset)",
        min=0,
        max=30 * 86400,
    )
    xid_fatal_hold_s: float = opt(
        3600.0,
        "on a driver without NVML's recovery-action field, a fatal Xid clears this long after it last "
        "occurred unless a reset was seen first (docs/xid.md); 0: only a seen reset clears it",
        min=0,
        max=30 * 86400,
    )


def worst(*states: str) -> str:
    return max(states, key=_RANK.__getitem__, default=HEALTHY)


# --- the Xid catalogue --------------------------------------------------------------------


class XidTableError(ValueError):
    """A malformed Xid table; the message names the file and line."""


@dataclass(frozen=True)
class XidInfo:
    code: int
    cls: str  # fatal | degrading | info
    description: str
    action: str = XID_UNLISTED  # NVIDIA's immediate action (XID_ACTIONS, WORKFLOW_*) or UNLISTED
    applies_to: str = ""  # the GPU generations the catalogue lists it for ("": all)
    recovery_action: str = ""  # Xid 154: the recovery action it named (RECOVERY_XID_ACTION)


class XidTable:
    def __init__(self, entries: dict[int, XidInfo]) -> None:
        self.entries = dict(entries)

    def classify(self, code: int) -> XidInfo:
        # Unknown codes are degrading with the action UNLISTED: worth a look, not worth
        # draining the GPU for, and no healing rule keys on them.
        return self.entries.get(code) or XidInfo(code, "degrading", "Xid not in the table", XID_UNLISTED)

    def __len__(self) -> int:
        return len(self.entries)


_XID_CODE = re.compile(r"[0-9]{1,5}")


def parse_xid_table(text: str, source: str = "xid_table.csv") -> XidTable:
    entries: dict[int, XidInfo] = {}
    header_seen, header = False, _HEADER_V1
    for where, line, cells in catalogue.rows(text, source, XidTableError):
        if not header_seen:
            if cells not in (_HEADER_V1, _HEADER_V2):
                raise XidTableError(
                    f"{where}: expected the header 'code,class,action,applies_to,description' "
                    f"(or 'code,class,description'), got {line[:80]!r}"
                )
            header, header_seen = cells, True
            continue
        if len(cells) != len(header):
            raise XidTableError(f"{where}: expected {len(header)} columns ({','.join(header)}), got {len(cells)}")
        if header == _HEADER_V2:
            code_s, cls, action, applies, desc = cells
        else:
            code_s, cls, desc = cells
            action, applies = _LEGACY_ACTION.get(cls, ""), ""
        # ASCII digits only: str.isdigit() takes "²" (which int() then refuses) and int()
        # takes "٣" and "1_0"; five digits bound the conversion.
        if not _XID_CODE.fullmatch(code_s) or not 1 <= int(code_s) <= 65535:
            raise XidTableError(f"{where}: code: expected an integer 1..65535, got {code_s[:20]!r}")
        if cls not in XID_CLASSES:
            raise XidTableError(f"{where}: class: expected one of {', '.join(XID_CLASSES)}, got {cls!r}")
        if action not in XID_ACTIONS and not _WORKFLOW.fullmatch(action):
            raise XidTableError(
                f"{where}: action: expected one of {', '.join(XID_ACTIONS)} or WORKFLOW_<NAME>, got {action[:40]!r}"
            )
        if _ACTION_CLASS.get(action, cls) != cls:
            raise XidTableError(f"{where}: class: {action} needs the class {_ACTION_CLASS[action]}, got {cls!r}")
        if not _APPLIES_TO.fullmatch(applies):
            raise XidTableError(
                f"{where}: applies_to: expected GPU generations (e.g. 'A100 H100'), got {applies[:40]!r}"
            )
        if not desc:
            raise XidTableError(f"{where}: description: expected text, got nothing")
        code = int(code_s)
        if code in entries:
            raise XidTableError(f"{where}: code {code} is listed twice")
        entries[code] = XidInfo(code, cls, desc, action, applies)
    if not header_seen:
        raise XidTableError(f"{source}: empty table (expected the header 'code,class,action,applies_to,description')")
    return XidTable(entries)


def load_xid_table(path: str | None = None) -> XidTable:
    """The table at `path`, or the shipped one when path is empty/None."""
    if not path:
        return shipped_xid_table()
    return parse_xid_table(read_text(path, XidTableError, "the Xid table"), str(Path(path)))


@functools.lru_cache(maxsize=1)
def shipped_xid_table() -> XidTable:
    text = resources.files("mscale.probes").joinpath("xid_table.csv").read_text()
    return parse_xid_table(text, "xid_table.csv")


# --- rates ----------------------------------------------------------------------------------


class RateWindow:
    """Rate (per second) of a monotonic counter over a sliding window. A counter that goes
    down (a GPU reset clears volatile counters) restarts the window."""

    def __init__(self, window_s: float, min_span_s: float = MIN_RATE_SPAN_S) -> None:
        self.window_s, self.min_span_s = window_s, min_span_s
        self._points: deque[tuple[float, int]] = deque()

    def update(self, now: float, value: int | None) -> float | None:
        if value is None:
            return None
        if self._points and value < self._points[-1][1]:
            self._points.clear()
        self._points.append((now, value))
        while len(self._points) > 1 and self._points[0][0] < now - self.window_s:
            self._points.popleft()
        t0, v0 = self._points[0]
        return (value - v0) / max(now - t0, self.min_span_s)


# --- the model --------------------------------------------------------------------------------


@dataclass(frozen=True)
class HealthReason:
    key: str  # stable identity across samples: "temperature", "nvlink:2", "xid:79", ...
    reason: Reason
    state: str  # the state this reason alone implies (degraded | failed)
    text: str


@dataclass(frozen=True)
class Health:
    state: str
    reasons: tuple[HealthReason, ...] = ()

    @property
    def texts(self) -> tuple[str, ...]:
        return tuple(r.text for r in self.reasons)


@dataclass
class _GpuMemory:
    sbe: RateWindow
    replay: RateWindow
    links_seen_up: set[int] = field(default_factory=set)
    xids: dict[int, float] = field(default_factory=dict)  # active code -> last time seen
    recovery_action: int | None = None
    xid_info: dict[int, XidInfo] = field(default_factory=dict)  # how each active code was judged
    ecc_volatile: tuple[int | None, int | None] = (None, None)  # (single-bit, double-bit) last read
    lost: bool = False
    health: Health = field(default_factory=lambda: Health(HEALTHY))


@dataclass(frozen=True)
class Update:
    """The outcome of one reading: the GPU's health, the reasons that are new since the
    previous reading, the previous state, and the measured rates."""

    health: Health
    new_reasons: tuple[HealthReason, ...]
    previous: str
    sbe_per_hour: float | None
    pcie_replays_per_min: float | None
    reset_seen: bool


class HealthModel:
    """Per-GPU health with the little memory the rules need (rates, links seen up, Xids
    since the last reset). Not thread-safe: one probe thread drives it."""

    def __init__(self, cfg: HealthSection, xids: XidTable | None = None) -> None:
        self.cfg = cfg
        self.xids = xids if xids is not None else load_xid_table(cfg.xid_table or None)
        self._gpus: dict[int, _GpuMemory] = {}

    def _mem(self, gpu: int) -> _GpuMemory:
        if gpu not in self._gpus:
            self._gpus[gpu] = _GpuMemory(RateWindow(self.cfg.rate_window_s), RateWindow(self.cfg.rate_window_s))
        return self._gpus[gpu]

    def judge_xid(self, code: int, message: str = "", recovery_action: int | None = None) -> XidInfo:
        """The table's row for `code`; for Xid 154, the recovery action it names (from its
        message, else the field read with it) decides the action and class."""
        info = self.xids.classify(code)
        if code != XID_RECOVERY_ACTION_CHANGED:
            return info
        value = parse_recovery_action(message) if message else None
        value = value if value is not None else recovery_action
        if value not in RECOVERY_XID_ACTION:
            return info
        name, action, cls = RECOVERY_XID_ACTION[value]
        return XidInfo(code, cls, f"GPU recovery action changed to {name}", action, info.applies_to, name)

    def observe_xid(self, gpu: int, code: int, now: float, info: XidInfo | None = None) -> XidInfo:
        info = info or self.xids.classify(code)
        m = self._mem(gpu)
        if info.cls in _CLASS_STATE:
            m.xids[code] = now
            m.xid_info[code] = info
        elif code in m.xid_info:  # a later Xid 154 naming no action: the earlier one lapses
            m.xids.pop(code, None)
            del m.xid_info[code]
        return info

    def update(self, gpu: int, r: Any, now: float) -> Update:
        """`r` is a GpuSample's readings (mscale.probes.gpu.GpuSample, health not yet set)."""
        m = self._mem(gpu)
        reset = self._note_reset(m, r)
        self._expire_xids(m, now)
        sbe_rate = m.sbe.update(now, r.ecc_sbe_volatile)
        replay_rate = m.replay.update(now, r.pcie_replay_count)
        sbe_per_hour = sbe_rate * 3600 if sbe_rate is not None else None
        replays_per_min = replay_rate * 60 if replay_rate is not None else None
        reasons = self._failed(m, r) + self._degraded(m, r, sbe_per_hour, replays_per_min)
        health = Health(worst(*(x.state for x in reasons)), tuple(reasons))
        before = {x.key for x in m.health.reasons}
        new = tuple(x for x in reasons if x.key not in before)
        previous, m.health = m.health.state, health
        return Update(health, new, previous, sbe_per_hour, replays_per_min, reset)

    @staticmethod
    def _note_reset(m: _GpuMemory, r: Any) -> bool:
        """Whether the GPU was reset since the last sample (its Xid-based reasons cleared then),
        and the readings that show the next one remembered."""
        # A GPU reset clears the Xid-based reasons: the driver's recovery action falls back
        # to none, a lost GPU answers again, or a volatile ECC counter goes down (a reset
        # zeroes them; that is how a driver without the recovery-action field shows one).
        volatile = (r.ecc_sbe_volatile, r.ecc_dbe_volatile)
        counters_fell = any(
            before is not None and now_v is not None and now_v < before
            for before, now_v in zip(m.ecc_volatile, volatile, strict=True)
        )
        reset = (
            (m.recovery_action not in (None, 0) and r.recovery_action == 0) or (m.lost and not r.lost) or counters_fell
        )
        if reset:
            m.xids.clear()
            m.xid_info.clear()
            m.links_seen_up.clear()
        if r.recovery_action is not None:
            m.recovery_action = r.recovery_action
        if not r.lost:
            m.ecc_volatile = volatile
        m.lost = r.lost
        return reset

    def _expire_xids(self, m: _GpuMemory, now: float) -> None:
        """Xids whose class holds only for a while (degrading; fatal where no reset shows) lapse."""
        holds = {"degrading": self.cfg.xid_degraded_hold_s}
        if m.recovery_action is None and self.cfg.xid_fatal_hold_s > 0:
            # no recovery-action field: a reset with no counter to show it would otherwise
            # leave a fatal Xid standing forever
            holds["fatal"] = self.cfg.xid_fatal_hold_s
        for code, seen in list(m.xids.items()):
            hold = holds.get(m.xid_info.get(code, self.xids.classify(code)).cls)
            if hold is not None and now - seen > hold:
                del m.xids[code]
                m.xid_info.pop(code, None)

    def _failed(self, m: _GpuMemory, r: Any) -> list[HealthReason]:
        """The reasons a GPU fails (lost, uncorrectable ECC, failed remap) and its standing Xids."""
        out = []
        if r.lost:
            out.append(
                HealthReason("lost", Reason.GPU_LOST, FAILED, f"GPU is lost: {r.lost_reason or 'fallen off the bus'}")
            )
        if r.ecc_dbe_volatile:
            why = f"{r.ecc_dbe_volatile} double-bit ECC error(s) since the last reset"
            out.append(HealthReason("ecc_dbe", Reason.GPU_ECC_DBE, FAILED, why))
        if r.remapped_rows_failed:
            out.append(HealthReason("remap_failed", Reason.GPU_RESET_REQUIRED, FAILED, "row remapping failed"))
        for code in sorted(m.xids):
            info = m.xid_info.get(code) or self.xids.classify(code)
            why = f"Xid {code} ({info.cls}, {info.action}): {info.description}"
            out.append(HealthReason(f"xid:{code}", Reason.GPU_XID, _CLASS_STATE[info.cls], why))
        return out

    def _degraded(
        self, m: _GpuMemory, r: Any, sbe_per_hour: float | None, replays_per_min: float | None
    ) -> list[HealthReason]:
        """The reasons a GPU is degraded: heat, ECC and PCIe error rates, a link down, a pending reset."""
        cfg, out = self.cfg, []
        t = cfg.temperature_degraded_c
        if r.temperature_c is not None and r.temperature_c >= t:
            why = f"temperature {r.temperature_c:g} C >= {t:g} C"
            out.append(HealthReason("temperature", Reason.GPU_TEMPERATURE, DEGRADED, why))
        if sbe_per_hour is not None and sbe_per_hour > cfg.sbe_per_hour_degraded:
            why = f"single-bit ECC errors at {sbe_per_hour:.0f}/h > {cfg.sbe_per_hour_degraded:g}/h"
            out.append(HealthReason("sbe_rate", Reason.GPU_ECC_SBE_STORM, DEGRADED, why))
        if replays_per_min is not None and replays_per_min > cfg.pcie_replays_per_min_degraded:
            why = f"PCIe replays at {replays_per_min:.0f}/min > {cfg.pcie_replays_per_min_degraded:g}/min"
            out.append(HealthReason("pcie_replay", Reason.GPU_PCIE_REPLAY, DEGRADED, why))
        for link in r.nvlinks:
            if link.up:
                m.links_seen_up.add(link.link)
            elif link.link in m.links_seen_up:
                why = f"NVLink link {link.link} is down"
                out.append(HealthReason(f"nvlink:{link.link}", Reason.GPU_NVLINK_DOWN, DEGRADED, why))
        if r.remapped_rows_pending or r.retired_pages_pending:
            what = "row remap" if r.remapped_rows_pending else "page retirement"
            why = f"{what} pending: the GPU needs a reset"
            out.append(HealthReason("reset_pending", Reason.GPU_RESET_REQUIRED, DEGRADED, why))
        return out


def xid_markdown(table: XidTable | None = None) -> str:
    """The Xid table of docs/xid.md, generated from the shipped CSV (a test keeps them in step)."""
    table = table or shipped_xid_table()
    rows = ["| Xid | NVIDIA's action | class | health | applies to | meaning |", "|---|---|---|---|---|---|"]
    for code in sorted(table.entries):
        x = table.entries[code]
        health = _CLASS_STATE.get(x.cls, "unchanged")
        rows.append(f"| {code} | {x.action} | {x.cls} | {health} | {x.applies_to or 'all'} | {x.description} |")
    return "\n".join(rows) + "\n"
