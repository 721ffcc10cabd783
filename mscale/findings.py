"""Findings: the one typed record every detector, probe and action reports.

Metrics, the event API, logs and the healing policy all consume the same `Finding`, so a
fault seen by two paths can be recognised as one (see `Finding.fault_key`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum


class Severity(str, Enum):
    CRITICAL = "critical"  # P0
    WARNING = "warning"  # P1
    INFO = "info"  # P2


class Reason(str, Enum):
    """Reason codes. One enum for the whole project: policy tables key on these."""

    # GPU and driver (probes/gpu, probes/dcgm, sim)
    GPU_XID = "gpu_xid"
    GPU_ECC_DBE = "gpu_ecc_dbe"
    GPU_ECC_SBE_STORM = "gpu_ecc_sbe_storm"
    GPU_TEMPERATURE = "gpu_temperature"
    GPU_NVLINK_DOWN = "gpu_nvlink_down"
    GPU_PCIE_REPLAY = "gpu_pcie_replay"
    GPU_LOST = "gpu_lost"
    GPU_HEALTH_CHANGED = "gpu_health_changed"
    GPU_RECOVERED = "gpu_recovered"
    GPU_RESET_REQUIRED = "gpu_reset_required"  # row remap / page retirement pending or failed
    NODE_DRAIN_REQUIRED = "node_drain_required"  # a GPU needs the node rebooted (RESTART_BM)
    # CUDA driver uprobes (probes/ebpf)
    TRAINING_HANG = "training_hang"
    TRAINING_HANG_CLEARED = "training_hang_cleared"
    SYNC_STALL = "sync_stall"
    SYNC_STALL_CLEARED = "sync_stall_cleared"
    CUDA_ALLOC_FAILURE = "cuda_alloc_failure"
    # In-process detectors (probes/checksum, probes/loss)
    CHECKSUM_FAILURE = "checksum_failure"
    CHECKSUM_L1_TRIGGER = "checksum_l1_trigger"
    NONFINITE_OUTPUT = "nonfinite_output"
    LOSS_NONFINITE = "loss_nonfinite"
    INPUT_NONFINITE = "input_nonfinite"  # NaN/Inf in the batch, before the first MPU (hook/checks/inputs)
    LOSS_SPIKE_WARN = "loss_spike_warn"
    LOSS_SPIKE_ACTION = "loss_spike_action"
    LOSS_JUMP = "loss_jump"
    GRAD_NORM_SPIKE = "grad_norm_spike"
    GRAD_NORM_NONFINITE = "grad_norm_nonfinite"
    GRAD_NORM_JUMP = "grad_norm_jump"
    WEIGHT_CORRUPTION = "weight_corruption"  # a weight changed outside the optimizer (hook/checks/weights)
    GRADIENT_CORRUPTION = (
        "gradient_corruption"  # a weight gradient off its norm before the reduction (hook/checks/gradcheck)
    )
    OUTPUT_SHIFT = "output_shift"  # an MPU output's scale left its baseline, held (hook/checks/outstats)
    # several ranks (mscale.hook.core.agree)
    STEP_DROPPED_AGREED = "step_dropped_agreed"  # every rank drops a step another rank found bad
    MPU_GRADIENT_DROPPED_AGREED = "mpu_gradient_dropped_agreed"  # ... or only the MPU that failed its checksum
    REPLICA_DIVERGED = "replica_diverged"  # a rank's MPU weights differ from the other replicas'
    REPLICA_REPAIRED = "replica_repaired"  # ... and were copied back from a healthy rank
    # Agent and link
    PROBE_DOWN = "probe_down"
    PROBE_UP = "probe_up"
    JOB_REGISTERED = "job_registered"
    JOB_GONE = "job_gone"
    AGENT_UNTRUSTED = "agent_untrusted"  # the job's socket is served by a uid it does not trust
    ALERT_FIRING = "alert_firing"
    ALERT_RESOLVED = "alert_resolved"
    CHAOS_INJECTED = "chaos_injected"
    # Healing actions and snapshots
    HEAL_ACTION = "heal_action"
    FUSE_STATE = "fuse_state"  # a fuse state-machine transition of an MPU
    SNAPSHOT_WRITTEN = "snapshot_written"
    SNAPSHOT_FAILED = "snapshot_failed"
    SNAPSHOT_REFUSED = "snapshot_refused"  # on load: a file fails its manifest check, or does not fit
    SNAPSHOT_RESUMED = "snapshot_resumed"  # start-up restore from disk
    SNAPSHOT_TIER = "snapshot_tier"  # a snapshot tier on or off at start-up, and why (node_tier.py)
    ROLLBACK = "rollback"
    PROGRESS_BOUND = "progress_bound"  # a fault cost more than the progress bound: the job stopped itself
    # Resource contracts and the density guard (mscale.daemon.contract.service)
    CONTRACT_VIOLATED = "contract_violated"  # a plan thread runs outside its CPUs
    CONTRACT_COMPLIANT = "contract_compliant"  # every plan thread runs where its plan says (again)
    DENSITY_DEVIATION = "density_deviation"  # an MPU's compute density is off its profile, sustained
    # Fleet signals (mscale.daemon.stragglers)
    RANK_STRAGGLER = "rank_straggler"  # a rank computes slower than the job's other ranks, held
    MPU_STRAGGLER = "mpu_straggler"  # an MPU on a rank slower than on the job's other ranks, held
    STRAGGLER_CLEARED = "straggler_cleared"
    # Node remediation hand-off (mscale.kube.remediation)
    GPU_FAULT_VERDICT = "gpu_fault_verdict"  # a GPU shown at fault (SDC proven by an L1 swap, a fatal Xid)
    GPU_FAULT_CLEARED = "gpu_fault_cleared"  # ... reset and healthy again: the filings are undone
    REMEDIATION_FILING = "remediation_filing"  # one filer's file or clear, with its result


@dataclass(frozen=True)
class Finding:
    source: str
    reason: Reason
    severity: Severity
    message: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def fault_key(self, *label_names: str) -> tuple:
        """Identity of the underlying fault, for idempotence across report paths."""
        names = label_names or ("gpu_uuid", "mpu_id", "job_id")
        return (self.reason.value,) + tuple(self.labels.get(n, "") for n in names)

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "reason": self.reason.value,
            "severity": self.severity.value,
            "message": self.message,
            "labels": dict(self.labels),
            "time": self.time,
        }
