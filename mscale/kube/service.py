"""The agent's Kubernetes service: three loops on the agent's event loop, every API call off
it with a deadline, none able to stop the agent (a failure is logged, counted, retried on
the next turn).

- pod attribution: pod-resources List every `pod_resources_interval_s`, published as the
  immutable PodMap `state.snapshots["kube_pods"]` (dropped once older than `pod_resources_max_age_s`);
- the node condition and cordon: every `condition_interval_s`, from the GPU probe's snapshot;
- Events: non-fatal GPU findings, at most `max_events_per_minute`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import structlog

from mscale.findings import Finding, Severity
from mscale.kube.attribution import SNAPSHOT
from mscale.kube.node import SDC_SNAPSHOT, NodeWriter, condition_of, make_api
from mscale.kube.podresources import PodMap, list_pods
from mscale.kube.settings import KubernetesSection
from mscale.tasks import cancel_and_wait

log = structlog.get_logger("mscale.kube")
NODE_SNAPSHOT = "kube_node"  # AgentState.snapshots key of the NodeWriter's status


class KubeService:
    def __init__(self, state: Any, cfg: KubernetesSection, *, clock: Callable[[], float] = time.time) -> None:
        self.state, self.cfg, self.clock = state, cfg, clock
        self.node = state.node
        self.writer: NodeWriter | None = None
        self.pod_resources_errors = 0
        self._tasks: list[asyncio.Task] = []
        self._event_times: deque[float] = deque()
        self._queue: asyncio.Queue | None = None

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        async with asyncio.timeout(self.cfg.request_timeout_s + 1):  # not wait_for: it can drop a cancel
            return await asyncio.to_thread(fn, *args)

    # --- pod attribution ------------------------------------------------------------------

    async def refresh_pods(self) -> None:
        cfg = self.cfg
        try:
            pods: PodMap = await self._call(
                lambda: list_pods(
                    cfg.pod_resources_socket,
                    timeout_s=cfg.request_timeout_s,
                    resource_prefix=cfg.resource_prefix,
                    max_devices=cfg.max_devices,
                )
            )
        except Exception as e:  # any failure: keep serving, keep the cache until it is too old
            self.pod_resources_errors += 1
            log.warning("pod_resources_failed", error=str(e)[:300], socket=cfg.pod_resources_socket)
            old = self.state.snapshots.get(SNAPSHOT)
            if old is not None and self.clock() - old.time > cfg.pod_resources_max_age_s:
                del self.state.snapshots[SNAPSHOT]
            return
        self.state.snapshots[SNAPSHOT] = pods

    async def _pods_loop(self) -> None:
        while True:
            await self.refresh_pods()
            await asyncio.sleep(self.cfg.pod_resources_interval_s)

    # --- node condition, cordon ----------------------------------------------------------

    async def check_node(self) -> str:
        """One turn: write the condition the GPU snapshot calls for, then remediate."""
        writer = self.writer
        snap = self.state.snapshots.get("gpu")
        if writer is None or snap is None:
            return "none"
        cond = condition_of(snap, self.state.snapshots.get(SDC_SNAPSHOT, ()))
        now = self.clock()
        try:
            await self._call(writer.write_condition, cond, now)
            all_gpus = frozenset(g.uuid for g in snap.gpus)
            return str(await self._call(writer.remediate, cond, now, all_gpus))
        except Exception as e:
            writer.status.api_errors["node"] = writer.status.api_errors.get("node", 0) + 1
            log.warning("kube_node_update_failed", error=str(e)[:300], node=self.node)
            return "error"

    async def _node_loop(self) -> None:
        while True:
            await self.check_node()
            await asyncio.sleep(self.cfg.condition_interval_s)

    # --- Events ---------------------------------------------------------------------------

    def wants_event(self, f: Finding) -> bool:
        """Non-fatal GPU findings (a fatal one is the node condition)."""
        return f.source == "gpu" and f.severity != Severity.CRITICAL

    async def post_event(self, f: Finding) -> bool:
        writer = self.writer
        if writer is None:
            return False
        now = self.clock()
        while self._event_times and now - self._event_times[0] > 60:
            self._event_times.popleft()
        if len(self._event_times) >= self.cfg.max_events_per_minute:
            writer.status.events_dropped += 1
            return False
        self._event_times.append(now)
        try:
            await self._call(
                lambda: writer.post_event(f.reason.value, f.message, warning=f.severity == Severity.WARNING, now=now)
            )
        except Exception as e:
            writer.status.api_errors["event"] = writer.status.api_errors.get("event", 0) + 1
            log.warning("kube_event_failed", error=str(e)[:300], node=self.node)
            return False
        return True

    async def _events_loop(self, queue: asyncio.Queue) -> None:
        while True:
            f = await queue.get()
            # a slow API server builds no backlog: past a minute's worth, the oldest are dropped (counted)
            while queue.qsize() > self.cfg.max_events_per_minute:
                if self.wants_event(queue.get_nowait()) and self.writer is not None:
                    self.writer.status.events_dropped += 1
            if self.wants_event(f):
                await self.post_event(f)

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.cfg
        if cfg.pod_resources_socket:
            self._tasks.append(asyncio.create_task(self._pods_loop(), name="kube-pods"))
        if not self.node:
            log.error("kube_no_node_name", hint="set kubernetes.node_name or env NODE_NAME (downward API)")
            return
        try:
            api = await self._call(make_api, cfg)
            self.writer = NodeWriter(api, self.node, cfg)
            if cfg.cordon:
                await self._call(self.writer.adopt)
        except Exception as e:  # not in a cluster, no service account: pod labels only
            log.error("kube_api_unavailable", error=str(e)[:300], node=self.node)
            self.writer = None
            return
        self.state.snapshots[NODE_SNAPSHOT] = self.writer.status
        self._tasks.append(asyncio.create_task(self._node_loop(), name="kube-node"))
        if cfg.events:
            self._queue = self.state.events.subscribe()
            self._tasks.append(asyncio.create_task(self._events_loop(self._queue), name="kube-events"))

    async def stop(self) -> None:
        if self._queue is not None:
            self.state.events.unsubscribe(self._queue)
        await cancel_and_wait(self._tasks)
