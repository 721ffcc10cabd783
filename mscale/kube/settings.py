"""[kubernetes]: pod attribution, the node condition, Events and (opt-in) cordon."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import ClassVar

from mscale.options import opt

POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
CONDITION_TYPE = "GPUUnhealthy"
TAINT_KEY = "mscale.io/gpu-unhealthy"
CORDON_LABEL = "mscale.io/cordoned"  # set on the nodes the agents cordoned: the circuit breaker counts them
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


@dataclass(frozen=True)
class KubernetesSection:
    HELP: ClassVar[str] = "running on Kubernetes"
    enabled: bool = opt(
        False, "run on Kubernetes: pod labels on GPU and job series, node condition, Events (off: nothing changes)"
    )
    node_name: str = opt("", "this node's name in the API (empty: env NODE_NAME, from the downward API)")
    api_server: str = opt("", "API server URL (empty: in-cluster, from the pod's service account)")
    request_timeout_s: float = opt(10.0, "deadline of one API or pod-resources call", min=0.1, max=300)
    pod_resources_socket: str = opt(
        POD_RESOURCES_SOCKET, "the kubelet's pod-resources v1 socket (empty: no pod labels)"
    )
    pod_resources_interval_s: float = opt(
        10.0, "seconds between pod-resources List calls (GPU -> pod cache)", min=0.5, max=3600
    )
    pod_resources_max_age_s: float = opt(
        60.0, "pod labels older than this (List kept failing) are dropped rather than trusted", min=1, max=86400
    )
    max_devices: int = opt(
        1024, "device entries cached from one List; past it the rest are dropped and counted", min=1, max=65536
    )
    resource_prefix: str = opt("nvidia.com/", "device-plugin resource names that are GPUs start with this")
    condition_interval_s: float = opt(
        10.0, "seconds between checks of the GPU snapshot for the node condition and cordon", min=0.5, max=3600
    )
    condition_heartbeat_s: float = opt(
        300.0, "the node condition is rewritten at least this often, even unchanged", min=10, max=86400
    )
    events: bool = opt(True, "post non-fatal GPU findings as Kubernetes Events on the node")
    max_events_per_minute: int = opt(
        30, "Events posted per minute at most; past it they are dropped and counted", min=1, max=10000
    )
    cordon: bool = opt(False, "remediation: cordon the node on a fatal GPU fault (needs patch on nodes)")
    taint: bool = opt(False, f"with cordon: also taint the node {TAINT_KEY}=true:NoSchedule")
    max_cordoned_nodes: int = opt(
        1,
        f"circuit breaker: at most this many nodes of the cluster cordoned by the agents (those labelled {CORDON_LABEL})",
        min=1,
        max=100000,
    )
    uncordon_healthy_checks: int = opt(
        3, "consecutive healthy checks of a reset GPU before the node is uncordoned", min=1, max=1000
    )

    def check(self, key: str) -> None:
        from mscale.options import ConfigError

        if self.node_name and not _NAME.fullmatch(self.node_name):
            raise ConfigError(f"{key}.node_name: expected a Kubernetes node name, got {self.node_name!r}")
        if self.taint and not self.cordon:
            raise ConfigError(f"{key}.taint: needs {key}.cordon = true")
        if self.api_server and not re.match(r"https?://", self.api_server):
            raise ConfigError(f"{key}.api_server: expected an http(s):// URL, got {self.api_server!r}")

    def node(self) -> str:
        """The node's name when enabled: the key, else env NODE_NAME; '' off the cluster."""
        return (self.node_name or os.environ.get("NODE_NAME", "")) if self.enabled else ""
