"""Each in-memory snapshot verified off the training thread, and restored only once it passed.

What is verified: the test of trust.py on the largest magnitudes (`trust.suspect`): every weight
and optimizer-state tensor finite, a weight's largest magnitude not past 2^16 + 1 times the
larger of 1 and its largest in the newest snapshot before it that passed, Adam's moments within
their bound. One `_foreach_norm` of order inf over the snapshot's weights and one over its state.

Where: on the snapshot copier's thread (memory.py), queued right after the snapshot's copy, so it
runs once the copy has landed, on the snapshot's own host tensors, which the training no longer
writes (the snapshot is pinned meanwhile: its buffers are not reused). The training thread pays
nothing for it but the hand-over; each snapshot's weights' maxima are kept with its verdict as
the next one's baseline, so no snapshot's weights are read twice.

Trust. A snapshot is restored (a rollback, the steps a rollback is agreed on, the weight repair's
choice in trust.trusted) only once its verification completed and passed (`Verdict.passed`):
- failed: it is dropped from the kept snapshots at once, before its verdict is published (a
  restore waiting on it finds it gone and takes the one before), and at the engine's next step
  end (the training thread: the flags file has one writer) its step is flagged in the disk tiers
  (node_tier.Flags) and a SNAPSHOT_REFUSED warning says what it found;
- in flight: a restore waits for it, at most `timeout_s` (VERIFY_TIMEOUT_S) in all per call: it
  takes about 0.1 s on an 8M model, after a copy that itself must land first. Past that bound it
  is passed over for the newest one before it that passed (a warning in the log), never trusted
  unverified. The wait, not the previous one at once: a rollback to the newest snapshot loses the
  fewest steps, and the wait is rare (a fault within a verification's time of a snapshot).
What each verification found is published in order (`since`): the fuse reports the weights it
names as corrupted (mscale.hook.fuse.actions.restore_weights), at the first step end after it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import structlog
import torch

from mscale.findings import Reason, Severity
from mscale.snapshot import trust

if TYPE_CHECKING:
    from mscale.snapshot.memory import HostCopier, MemorySnapshot, Verdict
    from mscale.snapshot.store import MemoryStore

__all__ = ["VERIFY_TIMEOUT_S", "Verifier"]

log = structlog.get_logger("mscale.snapshot")

VERIFY_TIMEOUT_S = 60.0  # the longest a restore waits for a snapshot's copy and verification
RESULTS = 64  # verdicts kept for the fuse to read (one per snapshot: ample between two reads)


class Emit(Protocol):
    def __call__(self, reason: Reason, severity: Severity, message: str, **labels: object) -> object: ...


def landed(snap: MemorySnapshot, timeout: float) -> bool:
    """Whether the snapshot's copies land within `timeout` seconds (its copy's error raised)."""
    deadline = time.monotonic() + timeout
    if not snap.ready.wait_host(timeout):
        return False
    if snap.ready.error is not None:
        raise RuntimeError(f"its copy failed: {snap.ready.error}")
    done = threading.Event()
    while not all(ev.query() for ev in snap.ready.events):  # a lost GPU's copy never lands
        if time.monotonic() > deadline:
            return False
        done.wait(0.001)
    return True


class Verifier:
    """Verifies the engine's snapshots on its copier's thread (the module docstring)."""

    def __init__(self, store: MemoryStore, copier: HostCopier, flag: Callable[[int, int, str], None], emit: Emit):
        self.timeout_s = VERIFY_TIMEOUT_S
        self._store, self._flag, self._emit = store, flag, emit
        # where a verification runs: the copier's thread, after the copies queued before it
        # (benchmarks/verify_thread.py runs them on the training thread to compare)
        self.schedule: Callable[[Callable[[], None]], None] = copier.after_copy
        self._lock = threading.Lock()
        self._seq = 0
        self._results: deque[tuple[int, int, Verdict]] = deque(maxlen=RESULTS)  # (seq, step, verdict)
        self._failed: list[tuple[int, Verdict]] = []  # to flag and report on the training thread
        self.checked, self.cpu_s = 0, 0.0  # verifications run, and their CPU seconds on the copier's thread

    def submit(self, snap: MemorySnapshot, model: torch.nn.Module, optimizer: object) -> None:
        """Queues the verification of `snap` on the copier's thread, after its copy."""
        names = [n for n, _ in model.named_parameters()]
        bound = trust.moment_bound(optimizer)
        self._store.pin(snap)
        self.schedule(lambda: self._run(snap, names, bound))

    def _run(self, snap: MemorySnapshot, names: list[str], bound: float | None) -> None:
        verdict, t0 = snap.verdict, time.thread_time()
        try:
            if not landed(snap, self.timeout_s):
                verdict.error = f"its copy did not land within {self.timeout_s:g} s"
            else:
                verdict.maxima = trust.maxima(trust.host_copies(snap, names))
                verdict.bad = frozenset(trust.suspect(snap, verdict.maxima, bound, self._before(snap)))
        except Exception as e:  # a verification that could not run trusts nothing
            verdict.error = f"{type(e).__name__}: {e}"
        finally:
            verdict.cpu_s = time.thread_time() - t0
            self._publish(snap)

    def _before(self, snap: MemorySnapshot) -> dict[str, float] | None:
        """The weights' maxima of the newest kept snapshot before `snap` that passed."""
        older = [s for s in self._store.snapshots() if s.step < snap.step and s.verdict.passed()]
        return older[-1].verdict.maxima if older else None

    def _publish(self, snap: MemorySnapshot) -> None:
        verdict = snap.verdict
        failed = bool(verdict.error or verdict.bad)
        with self._lock:
            self.checked, self.cpu_s = self.checked + 1, self.cpu_s + verdict.cpu_s
            if not verdict.abandoned:
                self._seq += 1
                self._results.append((self._seq, snap.step, verdict))
            if failed:
                self._failed.append((snap.step, verdict))
        if failed:
            self._store.drop(snap)  # first: a restore that sees the verdict finds it gone
        verdict.finish()
        self._store.unpin(snap)

    def since(self, seq: int) -> list[tuple[int, int, Verdict]]:
        """(seq, step, verdict) of the verifications completed after `seq`, oldest first."""
        with self._lock:
            return [r for r in self._results if r[0] > seq]

    def settle(self) -> None:
        """On the training thread (the engine's step end): flags the steps of failed snapshots
        in the disk tiers and reports them."""
        with self._lock:
            failed, self._failed = self._failed, []
        for step, v in failed:
            what = v.error or f"implausible or not finite: {', '.join(sorted(v.bad)[:4])}"
            why = f"the in-memory snapshot of step {step} failed its verification ({what})"
            self._flag(step, step, why)
            self._emit(Reason.SNAPSHOT_REFUSED, Severity.WARNING, f"{why}: never restored", step=step, tier="memory")

    def forget_after(self, step: int) -> None:
        """A rollback to `step`: what the verifications of newer snapshots found goes unread
        (`since`: the weights it would name are restored); a failed one is still flagged."""
        with self._lock:
            for s in self._store.snapshots():
                if s.step > step:
                    s.verdict.abandoned = True
            kept = [r for r in self._results if r[1] <= step]
            self._results.clear()
            self._results.extend(kept)

    def _trusted(self, snap: MemorySnapshot, deadline: float) -> bool:
        if not snap.verdict.wait(max(0.0, deadline - time.monotonic())):
            log.warning("snapshot verification not finished in time: passed over", step=snap.step, s=self.timeout_s)
            return False
        return snap.verdict.passed()

    def passed_steps(self) -> list[int]:
        """The steps of the kept snapshots that passed, those in flight waited for (the module
        docstring: at most `timeout_s` in all)."""
        deadline = time.monotonic() + self.timeout_s
        return [s.step for s in self._store.snapshots() if self._trusted(s, deadline)]

    def newest_passed(self, step: int | None = None) -> MemorySnapshot | None:
        """The newest kept snapshot (of `step`) that passed, pinned (the caller unpins it); one
        in flight waited for as `passed_steps` does; None when none did."""
        deadline = time.monotonic() + self.timeout_s
        for s in reversed(self._store.snapshots()):
            if (step is None or s.step == step) and self._trusted(s, deadline) and self._store.pin_kept(s):
                return s
        return None
