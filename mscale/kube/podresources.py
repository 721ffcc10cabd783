"""Which pod holds which GPU: the kubelet's pod-resources v1 `List` over its Unix socket (the
source dcgm-exporter reads), turned into an immutable, bounded `PodMap`.

The device plugin names a GPU by its UUID (`GPU-...`, `MIG-...`) or, with its index strategy,
by its index; both are kept. One blocking call with a deadline: run it off the event loop.
"""

from __future__ import annotations

import importlib
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

LIST_METHOD = "/v1.PodResourcesLister/List"
MAX_REPLY_BYTES = 4 << 20  # gRPC's own default: a larger reply is refused, not buffered
_DEVICE_ID = re.compile(r"[A-Za-z0-9._:/-]{1,128}")
_K8S_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


class PodRef(NamedTuple):
    namespace: str
    pod: str
    container: str


@dataclass(frozen=True)
class PodMap:
    """device id -> the container it is allocated to; `dropped`: entries past the bound or
    with names that are not Kubernetes names."""

    devices: Mapping[str, PodRef] = field(default_factory=dict)
    time: float = 0.0
    dropped: int = 0

    def containers_of(self, namespace: str, pod: str) -> set[str]:
        return {r.container for r in self.devices.values() if (r.namespace, r.pod) == (namespace, pod)}


class PodResourcesError(RuntimeError):
    """The List call failed: the socket is absent, the kubelet refused or did not answer in time."""


def parse(reply: Any, *, resource_prefix: str, max_devices: int, now: float) -> PodMap:
    """A ListPodResourcesResponse (the generated message) -> PodMap. A device shared by several
    containers (time-slicing) keeps the first in (namespace, pod, container) order."""
    devices: dict[str, PodRef] = {}
    dropped = 0
    entries = []
    for pod in reply.pod_resources:
        for c in pod.containers:
            for d in c.devices:
                if not d.resource_name.startswith(resource_prefix):
                    continue
                for dev in d.device_ids:
                    entries.append((PodRef(pod.namespace, pod.name, c.name), dev))
    for ref, dev in sorted(entries):
        if not (_DEVICE_ID.fullmatch(dev) and all(_K8S_NAME.fullmatch(x) for x in ref)):
            dropped += 1
        elif dev in devices:
            continue
        elif len(devices) >= max_devices:
            dropped += 1
        else:
            devices[dev] = ref
    return PodMap(devices=devices, time=now, dropped=dropped)


def list_pods(
    socket_path: str, *, timeout_s: float, resource_prefix: str = "nvidia.com/", max_devices: int = 1024
) -> PodMap:
    """One List call on the kubelet's socket, with a deadline."""
    import grpc

    pb: Any = importlib.import_module("mscale.kube.podresources_pb2")  # generated: no static types

    options = [("grpc.max_receive_message_length", MAX_REPLY_BYTES), ("grpc.enable_retries", 0)]
    with grpc.insecure_channel(f"unix://{socket_path}", options=options) as channel:
        call = channel.unary_unary(
            LIST_METHOD,
            request_serializer=pb.ListPodResourcesRequest.SerializeToString,
            response_deserializer=pb.ListPodResourcesResponse.FromString,
        )
        try:
            reply = call(pb.ListPodResourcesRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            detail = e.details() if hasattr(e, "details") else str(e)
            raise PodResourcesError(f"pod-resources List on {socket_path}: {code}: {detail}") from None
    return parse(reply, resource_prefix=resource_prefix, max_devices=max_devices, now=time.time())
