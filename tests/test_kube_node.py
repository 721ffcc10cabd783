"""Node condition, Events and cordon (issue 14 item 4) through the official Kubernetes client,
against a local HTTP server implementing the node, node-status and event endpoints; every
request the agent makes is checked field by field."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from mscale.daemon.state import AgentState
from mscale.findings import Finding, Reason, Severity
from mscale.kube.node import condition_of
from mscale.kube.service import KubeService
from mscale.kube.settings import KubernetesSection
from mscale.probes.gpu_sample import GpuSample, GpuSnapshot
from support.kube import ApiServer, four_gpus, wait_until

NODE = "gpu-node-1"
MERGE = "application/strategic-merge-patch+json"


def snapshot(*failed: int, degraded: tuple[int, ...] = ()) -> GpuSnapshot:
    return four_gpus(failed, degraded)


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture
async def api():
    server = ApiServer()
    server.node(NODE)
    server.node("gpu-node-2")
    runner = await server.start()
    yield server
    await runner.cleanup()


async def start(api: ApiServer, clock: Clock, **cfg) -> tuple[KubeService, AgentState]:
    state = AgentState(node=NODE)
    state.publish("gpu", snapshot())
    kube = KubernetesSection(
        enabled=True,
        node_name=NODE,
        api_server=api.url,
        pod_resources_socket="",
        condition_interval_s=3600,  # one turn at start; the test drives the rest
        **cfg,
    )
    service = KubeService(state, kube, clock=clock)
    await service.start()
    await wait_until(lambda: any(r.path.endswith("/status") for r in api.requests), what="the first condition")
    # the request arrives before the writer has its answer: wait for the writer to book it, or a
    # test's own turn can run beside the first one and write the same condition again
    await wait_until(lambda: service.writer.status.condition is not None, what="the first condition booked")
    return service, state


def status_patches(api: ApiServer) -> list:
    return [r for r in api.requests if r.path == f"/api/v1/nodes/{NODE}/status"]


async def test_condition_follows_the_gpus_with_reason_and_action(api: ApiServer) -> None:
    clock = Clock()
    service, state = await start(api, clock)
    try:
        (first,) = status_patches(api)
        assert (first.method, first.content_type) == ("PATCH", MERGE)
        assert first.body == {
            "status": {
                "conditions": [
                    {
                        "type": "GPUUnhealthy",
                        "status": "False",
                        "reason": "GPUsHealthy",
                        "message": "no GPU of this node is failed",
                        "lastHeartbeatTime": iso(clock.t),
                        "lastTransitionTime": iso(clock.t),
                    }
                ]
            }
        }
        # unchanged and the heartbeat not due: nothing written
        clock.t += 10
        await service.check_node()
        assert len(status_patches(api)) == 1

        # GPU 2 fails with a fatal Xid: True, the Xid as the reason, the action in the message
        clock.t += 10
        state.publish("gpu", snapshot(2))
        await service.check_node()
        cond = status_patches(api)[-1].body["status"]["conditions"][0]
        assert (cond["type"], cond["status"], cond["reason"]) == ("GPUUnhealthy", "True", "GPUXid79")
        assert cond["message"].startswith("GPU 2 (GPU-2): Xid 79: GPU has fallen off the bus.")
        assert "Recommended action: drain the node and reboot it." in cond["message"]
        assert cond["lastTransitionTime"] == iso(clock.t)
        stored = {c["type"]: c for c in api.nodes[NODE]["status"]["conditions"]}
        assert stored["GPUUnhealthy"]["status"] == "True" and stored["Ready"]["status"] == "True"

        # the heartbeat rewrites it unchanged, keeping the transition time
        clock.t += 301
        await service.check_node()
        beat = status_patches(api)[-1].body["status"]["conditions"][0]
        assert beat["lastHeartbeatTime"] == iso(clock.t) and "lastTransitionTime" not in beat
        assert len(status_patches(api)) == 3
        # observe-only: never a patch of the node itself
        assert not [r for r in api.requests if r.path == f"/api/v1/nodes/{NODE}" and r.method == "PATCH"]
    finally:
        await service.stop()


async def test_non_fatal_gpu_findings_become_events_rate_limited(api: ApiServer) -> None:
    clock = Clock()
    service, state = await start(api, clock, max_events_per_minute=2)
    try:
        warn = Finding("gpu", Reason.GPU_ECC_SBE_STORM, Severity.WARNING, "GPU 1: 500 SBE/h", {"gpu": "1"})
        fatal = Finding("gpu", Reason.GPU_XID, Severity.CRITICAL, "GPU 2: Xid 79", {"gpu": "2"})
        other = Finding("link", Reason.JOB_REGISTERED, Severity.INFO, "job j", {})
        for f in (fatal, other, warn, warn, warn):
            state.events.emit(f)
        # the third warning is dropped as it is queued, while the first two may still be in flight
        await wait_until(
            lambda: service.writer.status.events_dropped == 1 and len(api.events) >= 2, what="the rate limit"
        )
        assert len(api.events) == 2  # the fatal one is the condition, the link one not a GPU finding
        (post, _) = [r for r in api.requests if r.method == "POST"]
        assert post.path == "/api/v1/namespaces/default/events"
        ev = post.body
        assert ev["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE}
        assert (ev["reason"], ev["type"], ev["message"]) == ("GpuEccSbeStorm", "Warning", "GPU 1: 500 SBE/h")
        assert ev["source"] == {"component": "mscale-agent", "host": NODE}
        assert ev["metadata"]["name"].startswith(f"{NODE}.mscale.") and ev["count"] == 1
        assert ev["firstTimestamp"] == ev["lastTimestamp"]  # RFC 3339, as metav1.Time parses it
        assert dt.datetime.fromisoformat(ev["firstTimestamp"]).timestamp() == clock.t
    finally:
        await service.stop()


async def test_cordon_circuit_breaker_and_uncordon_after_reset_and_health(api: ApiServer) -> None:
    clock = Clock()
    api.nodes[NODE]["spec"]["taints"] = [{"key": "team", "value": "ml", "effect": "NoSchedule"}]
    api.nodes["gpu-node-2"]["metadata"]["labels"]["mscale.io/cordoned"] = "true"
    service, state = await start(api, clock, cordon=True, taint=True, max_cordoned_nodes=1, uncordon_healthy_checks=2)
    try:
        # another node is already cordoned by mscale: the breaker refuses, with an Event
        state.publish("gpu", snapshot(3))
        assert await service.check_node() == "refused"
        listed = [r for r in api.requests if r.path == "/api/v1/nodes" and r.method == "GET"]
        assert listed[-1].query["labelSelector"] == "mscale.io/cordoned=true"
        assert "unschedulable" not in api.nodes[NODE]["spec"]
        assert api.events[-1]["reason"] == "CordonRefused"
        assert "max_cordoned_nodes = 1" in api.events[-1]["message"]

        # that node is uncordoned: the next check cordons and taints this one
        del api.nodes["gpu-node-2"]["metadata"]["labels"]["mscale.io/cordoned"]
        assert await service.check_node() == "cordoned"
        patch = [r for r in api.requests if r.path == f"/api/v1/nodes/{NODE}" and r.method == "PATCH"][-1]
        assert patch.content_type == MERGE
        assert patch.body["spec"] == {
            "unschedulable": True,
            "taints": [
                {"key": "team", "value": "ml", "effect": "NoSchedule"},
                {"key": "mscale.io/gpu-unhealthy", "value": "true", "effect": "NoSchedule"},
            ],
        }
        assert patch.body["metadata"]["labels"] == {"mscale.io/cordoned": "true"}
        assert patch.body["metadata"]["resourceVersion"]  # optimistic concurrency
        assert patch.body["metadata"]["annotations"]["mscale.io/cordon-reason"].startswith("GPUXid79: GPU 3")
        assert api.nodes[NODE]["spec"]["unschedulable"] is True

        # still failed: nothing more; healthy again (the model clears a failure only at a reset):
        # uncordoned after uncordon_healthy_checks consecutive healthy checks, not before
        assert await service.check_node() == "none"
        # reset, but GPU 3 comes back degraded: not a passed health check (another GPU's state is no matter)
        state.publish("gpu", snapshot(degraded=(3,)))
        assert await service.check_node() == "waiting"
        state.publish("gpu", snapshot(degraded=(1,)))
        assert await service.check_node() == "waiting"
        assert api.nodes[NODE]["spec"]["unschedulable"] is True
        state.publish("gpu", snapshot(3))  # failed again: the count starts over
        assert await service.check_node() == "none"
        state.publish("gpu", snapshot())
        assert await service.check_node() == "waiting"
        assert await service.check_node() == "uncordoned"
        node = api.nodes[NODE]
        assert "unschedulable" not in node["spec"]
        assert node["spec"]["taints"] == [{"key": "team", "value": "ml", "effect": "NoSchedule"}]
        assert "mscale.io/cordoned" not in node["metadata"]["labels"]
        assert "mscale.io/cordon-reason" not in node["metadata"].get("annotations", {})
    finally:
        await service.stop()


async def test_a_node_someone_else_cordoned_is_left_alone(api: ApiServer) -> None:
    clock = Clock()
    api.nodes[NODE]["spec"]["unschedulable"] = True  # an operator's cordon
    service, state = await start(api, clock, cordon=True)
    try:
        state.publish("gpu", snapshot(0))
        assert await service.check_node() == "none"
        state.publish("gpu", snapshot())
        for _ in range(5):
            assert await service.check_node() == "none"
        assert api.nodes[NODE]["spec"]["unschedulable"] is True  # never uncordoned by the agent
        assert not [r for r in api.requests if r.path == f"/api/v1/nodes/{NODE}" and r.method == "PATCH"]
    finally:
        await service.stop()


async def test_api_down_keeps_the_agent_serving(api: ApiServer) -> None:
    clock = Clock()
    service, state = await start(api, clock)
    try:
        del api.nodes[NODE]  # every call now answers 404
        state.publish("gpu", snapshot(1))
        assert await service.check_node() == "error"
        assert service.writer.status.api_errors == {"node": 1}
    finally:
        await service.stop()


def test_condition_names_every_failed_gpu_and_a_lost_one_first() -> None:
    snap = GpuSnapshot(
        time=0,
        backend="sim",
        gpus=(
            GpuSample(index=0, uuid="GPU-0", health="failed", lost=True, reasons=("GPU is lost",)),
            GpuSample(index=1, uuid="GPU-1", health="failed", ecc_dbe_volatile=2, reasons=("2 DBE",)),
            GpuSample(index=2, uuid="GPU-2", health="degraded", reasons=("hot",)),
        ),
    )
    cond = condition_of(snap)
    assert (cond.unhealthy, cond.reason) == (True, "GPULost")
    assert "GPU 0 (GPU-0): GPU is lost; GPU 1 (GPU-1): 2 DBE." in cond.message
    assert "GPU 2" not in cond.message  # degraded is an Event, not the condition
    assert "reseat or replace" in cond.message


async def test_end_to_end_fault_cordon_reset_uncordon_on_simulated_gpus(api: ApiServer, tmp_path) -> None:
    """The agent's own GPU probe on simulated GPUs drives it all: a degraded GPU is an Event, a
    fatal Xid sets the condition and cordons, and only the GPU's reset (then healthy checks)
    uncordons."""
    import time

    from aiohttp import web

    from mscale.daemon.app import build_probes, create_app, new_state
    from mscale.daemon.config import from_dict
    from mscale.probes.base import ProbeContext
    from mscale.sim.nvml import SimNvml
    from mscale.sim.timeline import event_from_dict

    config = from_dict(
        {
            "agent": {"listen": "127.0.0.1:0", "socket_path": str(tmp_path / "a.sock")},
            "probes": {"gpu": {"interval_s": 0.1}},
            "kubernetes": {
                "enabled": True,
                "node_name": NODE,
                "api_server": api.url,
                "pod_resources_socket": "",
                "condition_interval_s": 0.5,
                "cordon": True,
                "uncordon_healthy_checks": 2,
            },
        }
    )
    sim = SimNvml(4)
    state = new_state(config)
    ctx = ProbeContext(config=config, emit=state.events.emit, clock=time.time, jobs=state.registered_jobs, nvml=sim)
    app = create_app(
        config,
        state=state,
        probes=build_probes(config, ctx, ("gpu",), status=state.probe_status),
        nvml=sim,
        features=("mscale.daemon.kube",),
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()

    def condition() -> dict:
        return next((c for c in api.nodes[NODE]["status"]["conditions"] if c["type"] == "GPUUnhealthy"), {})

    try:
        await wait_until(lambda: condition().get("status") == "False", what="the healthy condition")
        sim.inject(event_from_dict({"gpu": 1, "fault": "temperature", "celsius": 95}, gpus=4))
        await wait_until(lambda: api.events, what="an Event for the hot GPU")
        assert api.events[0]["type"] == "Warning" and "GPU 1" in api.events[0]["message"]
        assert condition()["status"] == "False"  # degraded is not the condition

        sim.inject(event_from_dict({"gpu": 3, "fault": "xid", "code": 79}, gpus=4))
        await wait_until(lambda: api.nodes[NODE]["spec"].get("unschedulable"), what="the cordon")
        assert (condition()["status"], condition()["reason"]) == ("True", "GPUXid79")
        assert sim.uuids[3] in condition()["message"]
        assert api.nodes[NODE]["metadata"]["labels"]["mscale.io/cordoned"] == "true"

        sim.inject(event_from_dict({"gpu": 3, "fault": "recover"}, gpus=4))
        await wait_until(lambda: "unschedulable" not in api.nodes[NODE]["spec"], what="the uncordon")
        assert condition()["status"] == "False"
        patches = [(r.path, r.body) for r in api.requests if r.method == "PATCH"]
        node_path = f"/api/v1/nodes/{NODE}"
        cordon = next(i for i, (p, b) in enumerate(patches) if p == node_path and b["spec"].get("unschedulable"))
        cleared = next(i for i, (p, b) in enumerate(patches) if i > cordon and "GPUsHealthy" in str(b))
        uncordon = next(
            i for i, (p, b) in enumerate(patches) if p == node_path and b["spec"] == {"unschedulable": None}
        )
        assert cordon < cleared < uncordon  # condition cleared by the reset, then healthy checks, then uncordon
    finally:
        await runner.cleanup()


async def test_a_slow_api_server_builds_no_backlog_of_events(api: ApiServer) -> None:
    clock = Clock()
    api.hold = asyncio.Event()
    service, state = await start(api, clock, max_events_per_minute=5)
    try:
        warn = Finding("gpu", Reason.GPU_TEMPERATURE, Severity.WARNING, "GPU 1: 88 C", {"gpu": "1"})
        for _ in range(20):
            state.events.emit(warn)
        # one post in flight, held by the server; the queue behind it holds a minute's worth (5), the rest dropped
        posts = lambda: sum(r.method == "POST" for r in api.requests)  # noqa: E731
        await wait_until(lambda: posts() == 1 and service._queue.qsize() == 5, what="a held post")
        assert service.writer.status.events_dropped == 14
        api.hold.set()
        st = service.writer.status
        await wait_until(lambda: st.events_posted + st.events_dropped == 20, what="every finding handled")
        # then the rate limit: 5 posted in the minute, the sixth dropped
        assert (st.events_posted, st.events_dropped, len(api.events)) == (5, 15, 5)
    finally:
        await service.stop()
