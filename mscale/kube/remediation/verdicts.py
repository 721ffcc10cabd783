"""GPU verdicts: which GPUs of this node are shown at fault, from what the agent already hears.

Two kinds of evidence open a fault:

- `sdc`: the fuse proved a GPU computes wrong. A job reports an L1 swap (heal_action
  l1_swap, applied) made for a checksum or non-finite-output failure, off GPU g onto a
  standby; the same MPU of the same rank then comes clean there (its fuse_state goes
  l1_swapped -> recovered: `healing.recovery_clean_steps` clean steps on the standby). The
  outputs failed on g and not on the standby, with the same model and data: g is at fault.
  If the MPU fails on the standby too (a second swap, an L2 degrade), the fault followed the
  MPU, not the GPU: nothing is filed.
- `xid`: the GPU probe holds the GPU failed for a fatal Xid (the Xid table's RESET_GPU,
  RESTART_BM or CONTACT_SUPPORT), as the node condition does.

A fault is undone once the GPU was reset and then passed `clear_healthy_checks` health checks
in a row: for `xid` the health model clears a fatal Xid only at a reset, so healthy again is
the proof; for `sdc` the probe never saw anything wrong, so the book needs a reset seen by the
health model (`GpuSample.resets` went up) or a reboot of the node (a new boot id) first.

Only the agent's own values go into a fault: the GPU's index and UUID from the GPU probe's
snapshot (a GPU the probe does not know is never filed), the standby only as one of its GPU
indexes, the job, rank and MPU as the link registered them. The link (mscale.daemon.link_labels)
labels a job's proof with the GPU its MPU ran on, whatever the job said, and refuses a proof
about an MPU the job never registered; the book takes proofs from a job's reports only (source
`hook:...`).

Bounded: pending swaps (MAX_PENDING, MAX_PENDING_PER_JOB, a day at most) and open faults
(MAX_FAULTS, of which the jobs' `sdc` at most MAX_SDC_FAULTS: the probe's `xid` always has
room). A fault the state file's reader would refuse (`admit`) is never opened.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from mscale.findings import Finding, Reason, Severity
from mscale.kube.node import SDC_REASON  # the node condition's reason, the ExternalFault's errorCode

SDC, XID = "sdc", "xid"
KINDS = (SDC, XID)
# what a failed MPU's swap was decided for, when it is evidence against the GPU
SDC_TRIGGERS = frozenset({"checksum_l1_trigger", "checksum_failure", "nonfinite_output"})
# NVIDIA's immediate action (the Xid table's `action`) -> NVSentinel's RecommendedAction
ACTIONS = {"RESET_GPU": "COMPONENT_RESET", "RESTART_BM": "RESTART_BM", "CONTACT_SUPPORT": "CONTACT_SUPPORT"}
SDC_ACTION = "COMPONENT_RESET"  # a GPU reset, then its health checks; the fault stands until then
SAY = {
    "COMPONENT_RESET": "drain the GPU's workloads and reset the GPU (nvidia-smi -r), or reboot the node",
    "RESTART_BM": "drain the node and reboot it",
    "CONTACT_SUPPORT": "drain the node and contact the hardware vendor",
}
MAX_PENDING = 4096
MAX_PENDING_PER_JOB = 256
PENDING_TTL_S = 86400.0
MAX_FAULTS = 1024
MAX_SDC_FAULTS = MAX_FAULTS // 2  # the rest is the GPU probe's room
MAX_MESSAGE = 1024  # characters of a fault's message (printable only)
# a GPU UUID a fault may carry (NVML's GPU-... or MIG-...): never one that reads as an option
GPU_UUID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,127}")
# the facts a fault may carry, and their values: the link's job ids, ranks, MPU ids, indexes, Xids
FACT_KEYS = frozenset({"job_id", "rank", "mpu_id", "standby_gpu", "xid"})
FACT_VALUE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,255}")


def boot_id(path: str = "/proc/sys/kernel/random/boot_id") -> str:
    """This boot's id (a reboot resets every GPU); '' where the kernel does not say."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read(64).strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Fault:
    """One GPU shown at fault, as every filer files it."""

    kind: str  # sdc | xid
    gpu: int
    gpu_uuid: str
    reason: str  # GPUSilentDataCorruption | GPUXid<code>
    action: str  # NVSentinel RecommendedAction: COMPONENT_RESET | RESTART_BM | CONTACT_SUPPORT
    message: str
    since: float
    boot_id: str = ""
    resets: int = 0  # the GPU's reset count when the fault opened
    facts: Mapping[str, str] = field(default_factory=dict)  # job_id, rank, mpu_id, standby_gpu, xid

    @property
    def key(self) -> tuple[str, str]:
        """Idempotence: one filing per GPU and kind of fault."""
        return (self.gpu_uuid, self.kind)

    @property
    def fault_id(self) -> str:
        """A stable name part: `sdc-gpu-1a2b...` (DNS-label characters only)."""
        return re.sub(r"[^a-z0-9-]+", "-", f"{self.kind}-{self.gpu_uuid}".lower()).strip("-")[:80]

    @property
    def recommended(self) -> str:
        """The recommended action, said to an operator."""
        return SAY.get(self.action, SAY["COMPONENT_RESET"])


@dataclass
class _Swap:
    gpu: int
    gpu_uuid: str
    to_gpu: str
    time: float


@dataclass
class _Open:
    fault: Fault
    reset_seen: bool = False
    healthy_checks: int = 0


class VerdictBook:
    """Opens and closes faults; `emit` gets a finding for each. Not thread-safe: the agent's
    event loop drives it."""

    def __init__(
        self,
        *,
        clear_healthy_checks: int = 3,
        emit: Callable[[Finding], Any] = lambda f: None,
        clock: Callable[[], float] = time.time,
        boot: str = "",
        admit: Callable[[Fault], bool] = lambda f: True,
    ) -> None:
        self.clear_healthy_checks = clear_healthy_checks
        self.emit, self.clock, self.boot, self.admit = emit, clock, boot, admit
        self.pending: dict[tuple[str, str, str], _Swap] = {}
        self.pending_per_job: Counter[str] = Counter()
        self.open: dict[tuple[str, str], _Open] = {}
        self.sdc_open = 0
        self.dropped = 0  # evidence or faults past the caps, or refused

    def faults(self) -> tuple[Fault, ...]:
        return tuple(o.fault for o in self.open.values())

    # --- evidence from the jobs -----------------------------------------------------------

    def observe(self, f: Finding, gpus: Any = None) -> Fault | None:
        """A job's heal_action / fuse_state, as the link relayed it; `gpus` the GPU probe's
        snapshot (the only source of a GPU's UUID). The fault this opened, if any."""
        lab = f.labels
        key = (lab.get("job_id", ""), lab.get("rank", ""), lab.get("mpu_id", ""))
        if not f.source.startswith("hook:") or not all(key):  # only a job's own report, labelled by the link
            return None
        if f.reason is Reason.HEAL_ACTION and lab.get("result") == "applied":
            action = lab.get("action", "")
            if action == "l1_swap" and lab.get("reason", "") in SDC_TRIGGERS:
                if self._forget(key):
                    return None  # swapped again: the standby failed too, the fault followed the MPU
                self._swapped(key, lab, gpus)
            elif action in ("l1_swap", "l2_degrade", "l3_distill"):
                self._forget(key)  # a swap for another cause, or it failed on the standby
            return None
        if f.reason is Reason.FUSE_STATE and lab.get("state") == "recovered" and lab.get("before") == "l1_swapped":
            swap = self.pending.get(key)
            if swap is None:
                return None
            self._forget(key)
            job, rank, mpu = key
            standby = f"standby GPU {swap.to_gpu}" if swap.to_gpu else "a standby GPU"
            return self._open(
                Fault(
                    SDC,
                    swap.gpu,
                    swap.gpu_uuid,
                    SDC_REASON,
                    SDC_ACTION,
                    f"GPU {swap.gpu} ({swap.gpu_uuid}) computes wrong: MPU {mpu} of job {job} rank {rank} "
                    f"failed its checks there and came clean on {standby}",
                    self.clock(),
                    self.boot,
                    _resets_of(gpus, swap.gpu_uuid),
                    {
                        "job_id": job,
                        "rank": rank,
                        "mpu_id": mpu,
                        **({"standby_gpu": swap.to_gpu} if swap.to_gpu else {}),
                    },
                )
            )
        return None

    def _swapped(self, key: tuple[str, str, str], lab: Mapping[str, str], gpus: Any) -> None:
        """An L1 swap for an SDC trigger off the GPU the link labelled: pending until the MPU
        comes clean on the standby. The GPU's UUID is the probe's; a GPU it does not know
        (or an index that is not one) is no evidence."""
        gpu = lab.get("gpu", "")
        uuid = _uuid_of(gpus, int(gpu)) if gpu.isascii() and gpu.isdigit() else ""
        if not uuid:
            self.dropped += 1
            return
        self._prune()
        job = key[0]
        if len(self.pending) >= MAX_PENDING or self.pending_per_job[job] >= MAX_PENDING_PER_JOB:
            self.dropped += 1
            return
        to = lab.get("to_gpu", "")
        to = to if to.isascii() and to.isdigit() and _uuid_of(gpus, int(to)) else ""  # one of the node's GPUs
        self.pending[key] = _Swap(int(gpu), uuid, to, self.clock())
        self.pending_per_job[job] += 1

    def _forget(self, key: tuple[str, str, str]) -> bool:
        if self.pending.pop(key, None) is None:
            return False
        self.pending_per_job[key[0]] -= 1
        if self.pending_per_job[key[0]] <= 0:
            del self.pending_per_job[key[0]]
        return True

    def _prune(self) -> None:
        now = self.clock()
        for k in [k for k, s in self.pending.items() if now - s.time > PENDING_TTL_S]:
            self._forget(k)

    # --- the GPU probe's view --------------------------------------------------------------

    def check(self, snapshot: Any) -> tuple[list[Fault], list[Fault]]:
        """One health check: (opened, closed). Fatal Xids open `xid` faults; a reset then
        `clear_healthy_checks` healthy checks close any fault of that GPU."""
        gpus = {g.uuid: g for g in getattr(snapshot, "gpus", ()) or ()}
        opened = []
        for g in gpus.values():
            action = _fatal_action(g)
            if action is not None and (g.uuid, XID) not in self.open:
                xid = str(g.last_xid)
                what = "; ".join(g.reasons) or f"Xid {xid}"
                fault = self._open(
                    Fault(
                        XID,
                        g.index,
                        g.uuid,
                        f"GPUXid{xid}",
                        ACTIONS[action],
                        f"GPU {g.index} ({g.uuid}) failed: {what}",
                        self.clock(),
                        self.boot,
                        g.resets,
                        {"xid": xid},
                    )
                )
                if fault is not None:
                    opened.append(fault)
        closed = []
        for key, o in list(self.open.items()):
            g = gpus.get(o.fault.gpu_uuid)
            if g is None:
                continue  # not in this snapshot (lost, or no GPU data): no check passed
            o.reset_seen = o.reset_seen or g.resets > o.fault.resets or bool(self.boot and o.fault.boot_id != self.boot)
            reset = o.reset_seen or o.fault.kind == XID  # a fatal Xid clears only at a reset
            if getattr(g, "health", "healthy") != "healthy" or not reset:
                o.healthy_checks = 0
                continue
            o.healthy_checks += 1
            if o.healthy_checks >= self.clear_healthy_checks:
                del self.open[key]
                self.sdc_open -= o.fault.kind == SDC
                closed.append(o.fault)
                self.emit(
                    Finding(
                        "remediation",
                        Reason.GPU_FAULT_CLEARED,
                        Severity.INFO,
                        f"GPU {o.fault.gpu} ({o.fault.gpu_uuid}): {o.fault.reason} cleared: reset and "
                        f"{o.healthy_checks} healthy checks",
                        _labels(o.fault),
                        self.clock(),
                    )
                )
        return opened, closed

    def adopt(self, fault: Fault) -> None:
        """A fault remembered from before a restart (the GPU's reset count starts over)."""
        if fault.key not in self.open and self._room(fault):
            self._add(_Open(replace(fault, resets=0)))

    def _room(self, fault: Fault) -> bool:
        return len(self.open) < MAX_FAULTS and (fault.kind != SDC or self.sdc_open < MAX_SDC_FAULTS)

    def _add(self, o: _Open) -> None:
        self.open[o.fault.key] = o
        self.sdc_open += o.fault.kind == SDC

    def _open(self, fault: Fault) -> Fault | None:
        if fault.key in self.open:
            return None  # idempotent: the same GPU and kind is one fault
        text = "".join(c if c.isprintable() else "?" for c in fault.message[:MAX_MESSAGE])
        fault = replace(fault, message=text)
        if not self._room(fault) or not self.admit(fault):
            self.dropped += 1
            return None
        self._add(_Open(fault))
        self.emit(
            Finding(
                "remediation",
                Reason.GPU_FAULT_VERDICT,
                Severity.CRITICAL,
                f"{fault.message}. Recommended action: {fault.recommended}",
                _labels(fault),
                self.clock(),
            )
        )
        return fault


def _labels(fault: Fault) -> dict[str, str]:
    return {
        "gpu": str(fault.gpu),
        "gpu_uuid": fault.gpu_uuid,
        "kind": fault.kind,
        "cause": fault.reason,
        "action": fault.action,
        **fault.facts,
    }


def _fatal_action(g: Any) -> str | None:
    """The Xid table's action of a failed GPU's last Xid, when it is one that takes the GPU out."""
    if getattr(g, "health", "healthy") != "failed" or g.last_xid is None:
        return None
    action = dict(g.xid_actions).get(g.last_xid)
    return action if action in ACTIONS else None


def _uuid_of(snapshot: Any, gpu: int) -> str:
    for g in getattr(snapshot, "gpus", ()) or ():
        if g.index == gpu:
            return str(g.uuid)
    return ""


def _resets_of(snapshot: Any, uuid: str) -> int:
    for g in getattr(snapshot, "gpus", ()) or ():
        if g.uuid == uuid:
            return int(getattr(g, "resets", 0))
    return 0
