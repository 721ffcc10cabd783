"""The faults of the progress matrix (tests/test_progress_matrix.py) and what a run of it reports.

Each fault is the test's own hook on the tiny Hugging Face LLaVA (tests/support/tiny_hf.py), never
the project's injector, armed before each forward from the guard's step (a tensor switch, so a
compiled graph traces the hook once and never recompiles for it):

- noise: the vision tower's last `fc2` output plus Gaussian noise of its own std (1x), on
  steps [start, stop);
- nan: one element of the vision tower's first `fc1` output set to NaN on every step from
  `start` on (until `stop`); the hook sits on the module, so it follows the module wherever the
  fuse places it;
- flip: one high exponent bit (30) of one vision weight flipped once, after step `flip_at`
  (before the forward of step flip_at + 1), a direct write into the weight;
- tower: the vision tower's output (the hidden state LLaVA takes, after its last linear and its
  residual add) plus noise of its own std (1x), on steps [start, stop): no linear layer sees it.

`Record` is the guard plugin that keeps the findings; `report` turns a finished run into the
JSON the tests read.
"""

from __future__ import annotations

import hashlib
import math

import torch

FAULTS = ("clean", "noise", "nan", "flip", "tower")
FLIP_BIT = 30  # float32's highest exponent bit: a weight of 0.02 becomes about 1e37
FLIP_ROW, FLIP_COL = 40, 7  # in rank 1's half of the rows when FSDP shards the weight on 2 ranks
NOT_ABOVE = 8  # findings kept in the report per (reason, mpu_id)


def tower(model: torch.nn.Module) -> torch.nn.Module:
    return model.model.vision_tower


def layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return tower(model).encoder.layers


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded (DTensor) tensor; a plain one as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


class Fault:
    """One fault of FAULTS on `model` (the plain Hugging Face model, under any wrapper); `live`:
    this rank carries it (rank 1 where there are ranks). `arm(step)` before each forward."""

    def __init__(self, kind: str, model: torch.nn.Module, *, start: int, stop: int, flip_at: int, live: bool) -> None:
        if kind not in FAULTS:
            raise ValueError(f"fault: expected one of {', '.join(FAULTS)}, got {kind!r}")
        self.kind, self.model, self.start, self.stop, self.flip_at = kind, model, start, stop, flip_at
        self.live = live and kind != "clean"
        self.on = torch.zeros(())
        self.flipped: list[int] = []  # the step before whose forward the bit was flipped
        self.armed_steps = 0  # forwards run with the switch on
        if not self.live:
            return
        if kind == "noise":
            layers(model)[-1].mlp.fc2.register_forward_hook(self._noise, prepend=True)
        elif kind == "nan":
            layers(model)[0].mlp.fc1.register_forward_hook(self._nan, prepend=True)
        elif kind == "tower":
            tower(model).register_forward_hook(self._tower, prepend=True)

    def arm(self, step: int) -> None:
        if not self.live:
            return
        on = self.kind != "flip" and self.start <= step < self.stop
        self.on.fill_(1.0 if on else 0.0)
        self.armed_steps += on
        if self.kind == "flip" and not self.flipped and step == self.flip_at + 1:
            self.flip()
            self.flipped.append(step)

    def flip(self) -> None:
        weight = local(layers(self.model)[0].mlp.fc1.weight)
        row = FLIP_ROW % weight.shape[0]
        with torch.no_grad():
            bits = weight.detach().view(torch.int32)
            bits[row, FLIP_COL] ^= 1 << FLIP_BIT

    def _noise(self, module, args, out):  # in front of the guard's check: what the GEMM produced
        return out + self.on * out.detach().std() * torch.randn_like(out)

    def _nan(self, module, args, out):
        first = torch.zeros_like(out)
        first.view(-1)[0] = 1.0
        return torch.where(first * self.on > 0, torch.full_like(out, math.nan), out)

    def _tower(self, module, args, out):
        last = out.hidden_states[-1]
        noisy = last + self.on * last.detach().std() * torch.randn_like(last)
        out.hidden_states = (*out.hidden_states[:-1], noisy)
        out.last_hidden_state = noisy
        return out


class Record:
    """A guard plugin: every finding, the guard's step ends."""

    def __init__(self) -> None:
        self.findings: list = []
        self.ends = 0

    def on_finding(self, f) -> None:
        self.findings.append(f)

    def on_step_end(self, step: int, loss) -> None:
        self.ends += 1


def weights_state(model: torch.nn.Module) -> dict:
    """Whether every weight is finite, the largest magnitude among them (a flipped exponent bit
    left in place is finite, and some 1e37), and a hash of this rank's weights (its shards)."""
    h = hashlib.sha256()
    finite, largest = True, 0.0
    for name, p in sorted(model.named_parameters()):
        t = local(p.detach()).contiguous()
        finite = finite and bool(torch.isfinite(t).all())
        largest = max(largest, float(t.abs().max())) if t.numel() else largest
        h.update(name.encode() + t.view(-1).view(torch.uint8).numpy().tobytes())
    return {"finite": finite, "largest": largest, "hash": h.hexdigest()}


def findings_report(findings: list) -> dict:
    """Counts by severity and reason, the first NOT_ABOVE of each (reason, mpu_id) with their
    step, the heal actions applied and the first that failed (step, mpu_id, action, message)."""
    by_sev: dict[str, int] = {}
    by_reason: dict[str, int] = {}
    kept: list[dict] = []
    seen: dict[tuple, int] = {}
    applied: list[list] = []
    failed: list[list] = []
    for f in findings:
        sev, reason = f.severity.value, f.reason.value
        by_sev[sev] = by_sev.get(sev, 0) + 1
        by_reason[reason] = by_reason.get(reason, 0) + 1
        key = (reason, f.labels.get("mpu_id", ""))
        seen[key] = seen.get(key, 0) + 1
        if seen[key] <= NOT_ABOVE:
            kept.append({"reason": reason, "severity": sev, "mpu_id": key[1], "step": f.labels.get("step", "")})
            kept[-1]["message"] = f.message[:300]
        if reason == "heal_action" and f.labels.get("result") in ("applied", "failed"):
            done = applied if f.labels["result"] == "applied" else failed
            done.append([f.labels.get("step", ""), key[1], f.labels.get("action", ""), f.message[:200]])
    return {
        "severity": by_sev,
        "reasons": by_reason,
        "findings": kept,
        "applied": applied,
        "failed": failed[:NOT_ABOVE],
    }


def guard_report(guard, record: Record) -> dict:
    """What the guard and its fuse did: rollbacks, re-runs, the fuse levels, the findings."""
    fuse = getattr(guard, "fuse", None)
    out = findings_report(record.findings)
    out["rollbacks"] = list(fuse.states["rollback"].rollbacks) if fuse is not None else []
    out["reruns"] = len(fuse.reruns) if fuse is not None else 0
    out["levels"] = {m.mpu_id: m.fuse_level for m in guard.mpus} if fuse is not None else {}
    out["step_ends"] = record.ends
    return out
