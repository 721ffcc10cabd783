"""Protocol servers for the Kubernetes tests: the kubelet's pod-resources v1 gRPC service on a
Unix socket, and the few Kubernetes API endpoints the agent calls (aiohttp, on 127.0.0.1: nodes,
node status, events, cluster-scoped custom objects),
which record every request for the test to check field by field."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from mscale.probes.gpu_sample import GpuSample, GpuSnapshot


def pod_reply(pods: list[tuple[str, str, list[tuple[str, list[tuple[str, list[str]]]]]]]):
    """ListPodResourcesResponse from [(namespace, pod, [(container, [(resource, [device ids])])])]."""
    from mscale.kube import podresources_pb2 as pb

    return pb.ListPodResourcesResponse(
        pod_resources=[
            pb.PodResources(
                namespace=ns,
                name=name,
                containers=[
                    pb.ContainerResources(
                        name=c,
                        devices=[pb.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in devs],
                        cpu_ids=[2, 3],
                    )
                    for c, devs in containers
                ],
            )
            for ns, name, containers in pods
        ]
    )


class PodResourcesServer:
    """The kubelet's PodResourcesLister (v1) on a Unix socket; `reply` is what List answers,
    `calls` counts the List calls, `fail` makes List answer UNAVAILABLE."""

    def __init__(self, path: str, reply: Any) -> None:
        import grpc

        from mscale.kube import podresources_pb2 as pb

        self.reply, self.calls, self.fail = reply, 0, False
        self._lock = threading.Lock()

        def list_(request: Any, context: Any) -> Any:
            with self._lock:
                self.calls += 1
            if self.fail:
                context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet restarting")
            return self.reply

        handler = grpc.method_handlers_generic_handler(
            "v1.PodResourcesLister",
            {
                "List": grpc.unary_unary_rpc_method_handler(
                    list_,
                    request_deserializer=pb.ListPodResourcesRequest.FromString,
                    response_serializer=pb.ListPodResourcesResponse.SerializeToString,
                )
            },
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers((handler,))
        assert self.server.add_insecure_port(f"unix:{path}") != 0
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=None).wait(10)


@dataclass
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: Any


@dataclass
class ApiServer:
    """The node, node-status and event endpoints of the Kubernetes API, over a node table.
    Applies strategic-merge patches the way the API server does for the fields the agent sets
    (conditions merged by type, labels and annotations by key, null deletes)."""

    nodes: dict[str, dict] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    port: int = 0
    hold: asyncio.Event | None = None  # set: event posts wait for it (a slow API server)
    # cluster-scoped custom objects (NVSentinel's ExternalFault) by (group, version, plural) -> name -> object
    custom: dict[tuple[str, str, str], dict[str, dict]] = field(default_factory=dict)
    deny_custom: str = ""  # non-empty: creates are denied as an admission webhook does (400, this message)
    # the custom resources the server has a CRD for; any other answers 404
    crds: set[tuple[str, str, str]] = field(
        default_factory=lambda: {("nvsentinel.dgxc.nvidia.com", "v1", "externalfaults")}
    )

    def node(self, name: str, *, labels: dict | None = None, unschedulable: bool = False) -> None:
        self.nodes[name] = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "1", "labels": labels or {}},
            "spec": {"unschedulable": True} if unschedulable else {},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }

    async def _record(self, request: web.Request) -> Recorded:
        body = json.loads(await request.text()) if request.can_read_body else None
        rec = Recorded(request.method, request.path, dict(request.query), request.content_type, body)
        self.requests.append(rec)
        return rec

    def _get(self, name: str) -> dict:
        if name not in self.nodes:
            raise web.HTTPNotFound(text=json.dumps({"kind": "Status", "code": 404}), content_type="application/json")
        return self.nodes[name]

    async def read_node(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.json_response(self._get(request.match_info["name"]))

    async def list_nodes(self, request: web.Request) -> web.Response:
        rec = await self._record(request)
        key, _, value = rec.query.get("labelSelector", "").partition("=")
        items = [n for n in self.nodes.values() if not key or n["metadata"]["labels"].get(key) == value]
        return web.json_response({"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": items})

    async def patch_node(self, request: web.Request) -> web.Response:
        rec = await self._record(request)
        node = self._get(request.match_info["name"])
        if rec.content_type != "application/strategic-merge-patch+json":
            raise web.HTTPUnsupportedMediaType()
        meta = rec.body.get("metadata", {})
        if "resourceVersion" in meta and meta["resourceVersion"] != node["metadata"]["resourceVersion"]:
            raise web.HTTPConflict(text=json.dumps({"kind": "Status", "code": 409}), content_type="application/json")
        for key in ("labels", "annotations"):
            target = node["metadata"].setdefault(key, {})
            for k, v in meta.get(key, {}).items():
                if v is None:
                    target.pop(k, None)
                else:
                    target[k] = v
        for k, v in rec.body.get("spec", {}).items():
            if v is None:
                node["spec"].pop(k, None)
            else:
                node["spec"][k] = v
        for cond in rec.body.get("status", {}).get("conditions", []):
            conds = node["status"]["conditions"]
            old = next((c for c in conds if c["type"] == cond["type"]), None)
            if old is None:
                conds.append(dict(cond))
            else:
                old.update(cond)
        node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
        return web.json_response(node)

    async def create_event(self, request: web.Request) -> web.Response:
        rec = await self._record(request)
        if self.hold is not None:
            async with asyncio.timeout(10):
                await self.hold.wait()
        self.events.append(rec.body)
        return web.json_response(rec.body, status=201)

    async def create_custom(self, request: web.Request) -> web.Response:
        rec = await self._record(request)
        m = request.match_info
        if (m["group"], m["version"], m["plural"]) not in self.crds:
            return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
        objs = self.custom.setdefault((m["group"], m["version"], m["plural"]), {})
        name = rec.body["metadata"]["name"]
        if self.deny_custom:
            status = {"kind": "Status", "code": 400, "reason": "BadRequest", "message": self.deny_custom}
            return web.json_response(status, status=400)
        if name in objs:
            return web.json_response({"kind": "Status", "code": 409, "reason": "AlreadyExists"}, status=409)
        objs[name] = {**rec.body, "metadata": {**rec.body["metadata"], "uid": f"uid-{name}"}}
        return web.json_response(objs[name], status=201)

    async def delete_custom(self, request: web.Request) -> web.Response:
        await self._record(request)
        m = request.match_info
        objs = self.custom.get((m["group"], m["version"], m["plural"]), {})
        if m["name"] not in objs:
            return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
        del objs[m["name"]]
        return web.json_response({"kind": "Status", "status": "Success"})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/v1/nodes", self.list_nodes)
        app.router.add_get("/api/v1/nodes/{name}", self.read_node)
        app.router.add_patch("/api/v1/nodes/{name}", self.patch_node)
        app.router.add_patch("/api/v1/nodes/{name}/status", self.patch_node)
        app.router.add_post("/api/v1/namespaces/{namespace}/events", self.create_event)
        app.router.add_post("/apis/{group}/{version}/{plural}", self.create_custom)
        app.router.add_delete("/apis/{group}/{version}/{plural}/{name}", self.delete_custom)
        return app

    async def start(self) -> web.AppRunner:
        runner = web.AppRunner(self.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.port = runner.addresses[0][1]
        return runner

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def wait_until(cond: Any, timeout_s: float = 10.0, what: str = "condition") -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        v = cond()
        if v:
            return v
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def four_gpus(
    failed: tuple[int, ...] = (),
    degraded: tuple[int, ...] = (),
    *,
    degraded_reason: str = "row remap pending",
    resets: dict[int, int] | None = None,
) -> GpuSnapshot:
    """A simulated node of 4 GPUs (GPU-0..GPU-3): `failed` ones fallen off the bus (Xid 79),
    `degraded` ones with `degraded_reason`, the rest healthy; `resets` per index."""
    gpus = []
    for i in range(4):
        n = (resets or {}).get(i, 0)
        if i in failed:
            gpus.append(
                GpuSample(
                    index=i,
                    uuid=f"GPU-{i}",
                    health="failed",
                    reasons=("Xid 79: GPU has fallen off the bus",),
                    last_xid=79,
                    xid_errors=((79, 1),),
                    xid_actions=((79, "RESTART_BM"),),
                    resets=n,
                )
            )
        elif i in degraded:
            gpus.append(GpuSample(index=i, uuid=f"GPU-{i}", health="degraded", reasons=(degraded_reason,), resets=n))
        else:
            gpus.append(GpuSample(index=i, uuid=f"GPU-{i}", resets=n))
    return GpuSnapshot(time=0.0, backend="sim", gpus=tuple(gpus))
