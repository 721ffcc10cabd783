"""Runs each probe on its own interval, in its own worker thread, under a deadline.

A probe that raises or hangs is isolated: it is marked down (with the reason), counted,
logged once per state change, and the other probes keep running. A hung sample keeps its
thread; the probe is not sampled again until that call returns (quarantine).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from mscale.daemon.state import AgentState, ProbeStatus
from mscale.findings import Finding, Reason, Severity
from mscale.probes.base import Probe, ProbeUnavailable
from mscale.tasks import cancel_and_wait

log = structlog.get_logger("mscale.runner")

SAMPLE_THREAD = "probe-"  # the name prefix of each sample's thread


@dataclass
class ProbeTask:
    probe: Probe
    interval_s: float
    timeout_s: float
    status: ProbeStatus
    inflight: asyncio.Future[Any] | None = None


def _in_daemon_thread(fn: Callable[[], Any], name: str) -> asyncio.Future[Any]:
    """Run fn in a daemon thread: a hung hardware call must never block shutdown."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def target() -> None:
        try:
            result, error = fn(), None
        except BaseException as e:  # handed to the awaiting coroutine
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed while we were stuck
            pass

    threading.Thread(target=target, name=name, daemon=True).start()
    return fut


def probe_threads_left() -> list[str]:
    """Names of the sample threads still running: a hung call, or a BPF compile the stop did
    not wait for. Interpreter finalisation under such a thread can crash in C code."""
    return [t.name for t in threading.enumerate() if t.name.startswith(SAMPLE_THREAD) and t.is_alive()]


class ProbeRunner:
    def __init__(
        self, state: AgentState, probes: list[tuple[Probe, float, float]], clock: Callable[[], float] = time.time
    ) -> None:
        self.state = state
        self.clock = clock
        self.tasks = []
        for probe, interval_s, timeout_s in probes:
            status = state.probe_status.setdefault(probe.name, ProbeStatus(probe.name))
            self.tasks.append(ProbeTask(probe, interval_s, timeout_s, status))
        self._asyncio_tasks: list[asyncio.Task[Any]] = []
        self.close_grace_s = 2.0  # how long stop() lets a running sample finish

    def _mark(self, task: ProbeTask, up: bool, reason: str = "") -> None:
        st = task.status
        changed = st.up is not up
        st.up, st.reason = up, reason
        if not changed:
            return
        if up:
            self.state.events.emit(
                Finding("agent", Reason.PROBE_UP, Severity.INFO, f"probe {st.name} is up", {"probe": st.name})
            )
        else:
            self.state.events.emit(
                Finding(
                    "agent",
                    Reason.PROBE_DOWN,
                    Severity.WARNING,
                    f"probe {st.name} is down: {reason}",
                    {"probe": st.name},
                )
            )

    async def sample_once(self, task: ProbeTask) -> Any:
        st = task.status
        if task.inflight is not None and not task.inflight.done():
            st.errors_total += 1
            self._mark(task, False, f"previous sample still running after {task.timeout_s:g}s deadline (hung)")
            return None
        start = time.perf_counter()
        task.inflight = _in_daemon_thread(task.probe.sample, f"{SAMPLE_THREAD}{st.name}")
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for returns the result and drops
            # a cancel that lands in the same loop turn, and the loop then never stops.
            async with asyncio.timeout(task.timeout_s):
                snapshot = await asyncio.shield(task.inflight)
        except TimeoutError:
            st.errors_total += 1
            self._mark(task, False, f"sample timed out after {task.timeout_s:g}s")
            return None
        except ProbeUnavailable as e:
            self._mark(task, False, f"unavailable: {e}")
            return None
        except Exception as e:  # a probe bug must not take the agent down
            st.errors_total += 1
            self._mark(task, False, f"{type(e).__name__}: {e}")
            log.debug("probe_error", probe=st.name, exc_info=True)
            return None
        finally:
            st.last_duration_s = time.perf_counter() - start
        st.samples_total += 1
        st.last_success_time = self.clock()
        self.state.publish(st.name, snapshot)
        self._mark(task, True)
        return snapshot

    async def _loop(self, task: ProbeTask) -> None:
        while True:
            started = time.monotonic()
            await self.sample_once(task)
            await asyncio.sleep(max(0.0, task.interval_s - (time.monotonic() - started)))

    def start(self) -> None:
        for task in self.tasks:
            self._asyncio_tasks.append(asyncio.create_task(self._loop(task), name=f"probe:{task.probe.name}"))

    async def stop(self) -> None:
        await cancel_and_wait(self._asyncio_tasks)
        running = [t.inflight for t in self.tasks if t.inflight is not None and not t.inflight.done()]
        if running:  # a sample that ends soon ends before its probe closes under it
            await asyncio.wait(running, timeout=self.close_grace_s)
        for task in self.tasks:
            try:
                task.probe.close()
            except Exception:
                log.warning("probe_close_failed", probe=task.probe.name, exc_info=True)
            if task.inflight is not None and not task.inflight.done():
                task.inflight.cancel()  # its thread is a daemon: left behind, never joined
