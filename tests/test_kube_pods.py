"""Pod attribution (issue 14 item 3): the pod-resources v1 List, served by a real gRPC server
on a Unix socket, becomes pod/namespace/container labels on GPU series (cached, refreshed,
bounded, dropped when too old) and a job's own pod (downward API) labels its series."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mscale import link as protocol
from mscale.daemon import keys
from mscale.daemon.app import create_app
from mscale.daemon.config import Config
from mscale.daemon.settings import AgentSection
from mscale.kube.attribution import SNAPSHOT
from mscale.kube.podresources import PodResourcesError, list_pods
from mscale.kube.settings import KubernetesSection
from mscale.probes.gpu_sample import GpuSample, GpuSnapshot
from support import REPO
from support.kube import PodResourcesServer, pod_reply, wait_until

GPUS = GpuSnapshot(
    time=0.0,
    backend="sim",
    gpus=tuple(GpuSample(index=i, uuid=f"GPU-{i:04d}", name="sim", temperature_c=40.0 + i) for i in range(4)),
)
REPLY = [
    ("train", "llm-0", [("trainer", [("nvidia.com/gpu", ["GPU-0000", "GPU-0001"])]), ("sidecar", [])]),
    ("train", "llm-1", [("trainer", [("nvidia.com/gpu", ["2"])])]),  # the device plugin's index strategy
    ("other", "nic-user", [("app", [("rdma/hca", ["GPU-0003"])])]),  # not a GPU resource
]


@pytest.fixture
def pod_socket(tmp_path: Path):
    path = str(tmp_path / "kubelet.sock")
    server = PodResourcesServer(path, pod_reply(REPLY))
    yield path, server
    server.stop()


def test_list_maps_each_gpu_to_its_container(pod_socket) -> None:
    path, server = pod_socket
    pods = list_pods(path, timeout_s=5)
    assert server.calls == 1
    assert {d: tuple(r) for d, r in pods.devices.items()} == {
        "GPU-0000": ("train", "llm-0", "trainer"),
        "GPU-0001": ("train", "llm-0", "trainer"),
        "2": ("train", "llm-1", "trainer"),
    }
    assert pods.dropped == 0 and pods.containers_of("train", "llm-0") == {"trainer"}


def test_list_is_bounded_and_refuses_names_that_are_not_kubernetes_names(tmp_path: Path) -> None:
    path = str(tmp_path / "k.sock")
    many = [("ns", f"p{i}", [("c", [("nvidia.com/gpu", [f"GPU-{i}"])])]) for i in range(10)]
    bad = [("NS WITH SPACES", "p", [("c", [("nvidia.com/gpu", ["GPU-x"])])])]
    server = PodResourcesServer(path, pod_reply(many + bad))
    try:
        pods = list_pods(path, timeout_s=5, max_devices=4)
    finally:
        server.stop()
    assert len(pods.devices) == 4
    assert pods.dropped == 7  # 6 over the bound, 1 bad name
    assert "GPU-x" not in pods.devices


def test_list_failures_name_the_socket(tmp_path: Path, pod_socket) -> None:
    with pytest.raises(PodResourcesError, match="absent.sock"):
        list_pods(str(tmp_path / "absent.sock"), timeout_s=1)
    path, server = pod_socket
    server.fail = True
    with pytest.raises(PodResourcesError, match="UNAVAILABLE"):
        list_pods(path, timeout_s=5)


def test_generated_messages_match_the_proto(tmp_path: Path) -> None:
    """mscale/kube/podresources_pb2.py is what grpc_tools.protoc makes of the committed .proto."""
    from grpc_tools import protoc

    kube = REPO / "mscale" / "kube"
    assert protoc.main(["protoc", f"-I{kube}", f"--python_out={tmp_path}", str(kube / "podresources.proto")]) == 0
    assert (tmp_path / "podresources_pb2.py").read_text() == (kube / "podresources_pb2.py").read_text()


def _series(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _labels_of(text: str, name: str) -> list[dict[str, str]]:
    return [dict(labels) for (n, labels) in _series(text) if n == name]


async def _scrape(app) -> str:
    from aiohttp.test_utils import TestClient, TestServer

    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/metrics")
        assert resp.status == 200
        return await resp.text()


def _config(tmp_path: Path, pod_path: str, **kube) -> Config:
    return Config(
        agent=AgentSection(listen="127.0.0.1:0", socket_path=str(tmp_path / "agent.sock")),
        kubernetes=KubernetesSection(
            enabled=True, node_name="gpu-node-1", pod_resources_socket=pod_path, pod_resources_interval_s=0.5, **kube
        ),
    )


@pytest.mark.slow  # waits out refreshes and the cache's max age: about 3 s
async def test_gpu_series_gain_pod_labels_and_follow_the_kubelet(tmp_path: Path, pod_socket) -> None:
    path, server = pod_socket
    config = _config(tmp_path, path, pod_resources_max_age_s=1.0)
    app = create_app(config, probes=[], features=("mscale.daemon.api", "mscale.daemon.kube"))
    state = app[keys.STATE]
    state.publish("gpu", GPUS)
    assert state.node == "gpu-node-1"
    from aiohttp.test_utils import TestClient, TestServer

    async with TestClient(TestServer(app)) as client:

        async def scrape() -> str:
            return await (await client.get("/metrics")).text()

        await wait_until(lambda: SNAPSHOT in state.snapshots, what="the first List")
        temps = {lb["gpu"]: lb for lb in _labels_of(await scrape(), "mscale_gpu_temperature_celsius")}
        assert temps["0"] == {
            "gpu": "0",
            "gpu_uuid": "GPU-0000",
            "pod": "llm-0",
            "namespace": "train",
            "container": "trainer",
        }
        assert (temps["1"]["pod"], temps["2"]["pod"]) == ("llm-0", "llm-1")
        assert "pod" not in temps["3"]  # rdma/hca is not a GPU resource: no label rather than a wrong one
        # every GPU family, not only one: the health family of GPU 2
        assert all(lb["pod"] == "llm-1" for lb in _labels_of(await scrape(), "mscale_gpu_health") if lb["gpu"] == "2")

        # the kubelet moves GPU 0 to a new pod: the next refresh relabels it
        calls = server.calls
        server.reply = pod_reply([("train", "llm-9", [("trainer", [("nvidia.com/gpu", ["GPU-0000"])])])])
        await wait_until(lambda: server.calls > calls + 1, what="two refreshes")
        temps = {lb["gpu"]: lb for lb in _labels_of(await scrape(), "mscale_gpu_temperature_celsius")}
        assert temps["0"]["pod"] == "llm-9" and "pod" not in temps["1"]

        # the kubelet stops answering: labels stay while fresh, then go (never stale ones)
        server.fail = True
        await wait_until(lambda: SNAPSHOT not in state.snapshots, what="the cache to expire")
        temps = {lb["gpu"]: lb for lb in _labels_of(await scrape(), "mscale_gpu_temperature_celsius")}
        assert not any("pod" in lb for lb in temps.values())
        assert len(temps) == 4  # the GPU series themselves are untouched


async def test_a_job_registered_with_its_pod_labels_its_series(tmp_path: Path, pod_socket) -> None:
    """The hook library sends the downward API's POD_NAME/POD_NAMESPACE in its registration;
    the agent's link validates it and the job's series carry pod, namespace and container."""
    import aiohttp
    from aiohttp import web

    path, _ = pod_socket
    config = _config(tmp_path, path)
    app = create_app(config, probes=[], features=("mscale.daemon.api", "mscale.daemon.link", "mscale.daemon.kube"))
    state = app[keys.STATE]
    state.publish("gpu", GPUS)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    env = {"POD_NAME": "llm-0", "POD_NAMESPACE": "train"}
    mpus = [{"mpu_id": "001", "name": "vision", "gpu": 2, "gpu_uuid": "GPU-0002"}]
    try:
        await wait_until(lambda: SNAPSHOT in state.snapshots, what="the first List")
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=config.agent.socket_path)) as s:
            async with s.ws_connect("http://localhost/v1/link") as ws:
                # a malformed pod is refused, naming the field, and registers nothing
                bad = protocol.Register(
                    job_id="j",
                    rank=0,
                    pid=os.getpid(),
                    step=0,
                    mpus=tuple(protocol.MpuInfo(**m) for m in mpus),
                    pod=protocol.Pod("Bad Name", "train"),
                ).to_wire()
                await ws.send_str(json.dumps(bad))
                answer = json.loads((await ws.receive(timeout=10)).data)
                assert answer["type"] == "error" and "pod.name" in answer["error"]
                assert "j" not in state.jobs
                good = protocol.Register(
                    job_id="j",
                    rank=0,
                    pid=os.getpid(),
                    step=0,
                    mpus=tuple(protocol.MpuInfo(**m) for m in mpus),
                    pod=protocol.Pod.from_env(env),
                ).to_wire()
                await ws.send_str(json.dumps(good))
                assert json.loads((await ws.receive(timeout=10)).data)["type"] == "registered"
                async with aiohttp.ClientSession() as http:
                    text = await (await http.get(f"http://127.0.0.1:{port}/metrics")).text()
        # the job's own pod wins over the GPU's (its MPU runs on GPU 2, which the kubelet gives llm-1)
        info = _labels_of(text, "mscale_mpu_info")
        assert info and all(
            (lb["pod"], lb["namespace"], lb["container"]) == ("llm-0", "train", "trainer") for lb in info
        )
        for name in ("mscale_job_up", "mscale_job_step"):  # series with no GPU label too
            (labels,) = _labels_of(text, name)
            assert (labels["job_id"], labels["pod"], labels["namespace"]) == ("j", "llm-0", "train"), name
    finally:
        await runner.cleanup()


def test_pod_from_env_only_on_kubernetes() -> None:
    assert protocol.pod_from_env({}) is None  # off the cluster the registration is unchanged
    assert "pod" not in protocol.Register(job_id="j", rank=0, pid=1, pod=protocol.pod_from_env({})).to_wire()
    assert protocol.pod_from_env({"POD_NAME": "a-0", "POD_NAMESPACE": "ns"}) == protocol.Pod("a-0", "ns")
    assert protocol.pod_from_env({"POD_NAME": "a-0", "POD_NAMESPACE": "Not_A_Namespace"}) is None


async def test_off_the_cluster_nothing_changes(tmp_path: Path) -> None:
    config = Config(agent=AgentSection(listen="127.0.0.1:0", socket_path=str(tmp_path / "a.sock")))
    assert not config.kubernetes.enabled
    app = create_app(config, probes=[], features=("mscale.daemon.api", "mscale.daemon.kube"))
    app[keys.STATE].publish("gpu", GPUS)
    text = await _scrape(app)
    assert "mscale_kube_" not in text
    assert not any("pod" in lb for lb in _labels_of(text, "mscale_gpu_temperature_celsius"))


async def test_off_the_cluster_a_reported_pod_is_ignored(tmp_path: Path) -> None:
    """A job whose environment happens to carry POD_NAME registers as always; an agent not on
    Kubernetes keeps no pod and adds no label."""
    import aiohttp
    from aiohttp import web

    config = Config(agent=AgentSection(listen="127.0.0.1:0", socket_path=str(tmp_path / "a.sock")))
    app = create_app(config, probes=[], features=("mscale.daemon.api", "mscale.daemon.link", "mscale.daemon.kube"))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        mpus = [{"mpu_id": "001", "name": "text", "gpu": 0}]
        msg = protocol.Register(
            job_id="j",
            rank=0,
            pid=os.getpid(),
            step=0,
            mpus=tuple(protocol.MpuInfo(**m) for m in mpus),
            pod=protocol.Pod("p", "n"),
        ).to_wire()
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=config.agent.socket_path)) as s:
            async with s.ws_connect("http://localhost/v1/link") as ws:
                await ws.send_str(json.dumps(msg))
                assert json.loads((await ws.receive(timeout=10)).data)["type"] == "registered"
        job = app[keys.STATE].jobs["j"]
        assert job.pods == {}
        async with aiohttp.ClientSession() as http:
            text = await (await http.get(f"http://127.0.0.1:{runner.addresses[0][1]}/metrics")).text()
        assert 'pod="p"' not in text and 'job_id="j"' in text
    finally:
        await runner.cleanup()


@pytest.mark.slow  # imports torch: about 4 s on its own
def test_the_hook_library_sends_its_pod_from_the_downward_api(monkeypatch, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import mscale

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    monkeypatch.setenv("POD_NAME", "llm-0")
    monkeypatch.setenv("POD_NAMESPACE", "train")
    guard = mscale.attach(
        model, job_id="j", mpus={"text": model[0]}, socket_path=str(tmp_path / "none.sock"), snapshots=False
    )
    try:
        msg = guard.registration().to_wire()
        assert msg["pod"] == {"name": "llm-0", "namespace": "train"}
        assert protocol.Register.from_wire(msg).pod == protocol.Pod("llm-0", "train")
        monkeypatch.delenv("POD_NAME")
        assert "pod" not in guard.registration().to_wire()  # off Kubernetes the registration is as before
    finally:
        guard.detach()


def test_a_job_across_pods_labels_by_rank_and_never_guesses() -> None:
    from mscale.daemon.jobs import JobState
    from mscale.kube.attribution import _job_pod
    from mscale.kube.podresources import PodMap, PodRef

    pods = PodMap(devices={"GPU-0": PodRef("ml", "w-0", "trainer"), "GPU-1": PodRef("ml", "w-1", "trainer")})
    job = JobState(job_id="j", rank=0, pid=1)
    for rank in (0, 1):
        job.register(protocol.Register(job_id="j", rank=rank, pid=10 + rank, pod=protocol.Pod(f"w-{rank}", "ml")))
        job.ranks[rank] = 10 + rank
    assert _job_pod(job, "1", pods) == PodRef("ml", "w-1", "trainer")
    assert _job_pod(job, None, pods) is None  # a job-wide series of a job in two pods: no label
    del job.ranks[1]  # rank 1 left; a job-wide series is now the one live rank's pod
    assert _job_pod(job, None, pods) == PodRef("ml", "w-0", "trainer")
    assert _job_pod(job, None, None) == PodRef("ml", "w-0", "")  # no pod-resources: no container
