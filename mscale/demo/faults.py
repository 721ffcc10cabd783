"""The demo's fault script: what is sent through the agent's chaos API, at which step, and the
healing each fault should cause."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScriptedFault:
    at: int  # step it is sent at
    name: str
    expect: str  # the healing it should cause
    chaos: dict  # body for POST /api/v1/chaos
    sent_step: int = -1
    sent_time: float = 0.0
    reply: dict = field(default_factory=dict)
    mpus: dict = field(default_factory=dict)  # mpu_id -> (name, gpu) when it was sent


def script(steps: int) -> list[ScriptedFault]:
    """The fault sequence, placed at fractions of the run so --steps scales it."""

    def at(frac: float) -> int:
        return max(5, int(steps * frac))

    span = max(6, steps // 12)
    return [
        ScriptedFault(
            at(0.10),
            "SDC on the vision MPU's GPU 0",
            "L1 swap to a standby GPU",
            {"kind": "corrupt", "gpu": 0, "mode": "noise", "steps": span},
        ),
        ScriptedFault(
            at(0.28),
            "corruption following the vision MPU",
            "L1, then L2 (standby fails), then L3",
            {"kind": "corrupt", "mpu": "vision", "mode": "noise", "steps": span + 6},
        ),
        ScriptedFault(
            at(0.55),
            "25x loss spike",
            "LR x0.1 for a cooling window",
            {"kind": "loss_spike", "factor": 25.0, "steps": 1},
        ),
        ScriptedFault(at(0.66), "NaN loss", "step dropped, rollback, batch skipped", {"kind": "nan_loss", "steps": 1}),
        ScriptedFault(
            at(0.78),
            "Xid 79 on GPU 1 (aligner)",
            "emergency snapshot, GPU quarantined, L1 swap",
            {"kind": "xid", "gpu": 1, "code": 79, "corrupt": "noise"},
        ),
    ]
