"""Kubernetes metrics (mscale.kube): the pod-resources cache and what the agent did to its
node. No series off the cluster."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mscale.daemon.state import AgentState
from mscale.kube.attribution import SNAPSHOT as PODS
from mscale.kube.service import NODE_SNAPSHOT


def collect(state: AgentState) -> Iterable[Metric]:
    pods = state.snapshots.get(PODS)
    if pods is not None:
        devices = GaugeMetricFamily(
            "mscale_kube_pod_devices", "GPU devices the kubelet reports allocated to a container (pod-resources)"
        )
        devices.add_metric([], len(pods.devices))
        yield devices
        age = GaugeMetricFamily(
            "mscale_kube_pod_resources_timestamp_seconds",
            "Unix time of the pod-resources List the pod labels come from",
        )
        age.add_metric([], pods.time)
        yield age
        dropped = GaugeMetricFamily(
            "mscale_kube_pod_devices_dropped", "device entries of the last List left out (over max_devices, bad names)"
        )
        dropped.add_metric([], pods.dropped)
        yield dropped
    node = state.snapshots.get(NODE_SNAPSHOT)
    if node is None:
        return
    cond = GaugeMetricFamily(
        "mscale_kube_node_gpu_unhealthy",
        "1 while the agent holds the GPUUnhealthy node condition True",
        labels=["reason"],
    )
    if node.condition is not None:
        cond.add_metric([node.condition.reason], 1.0 if node.condition.unhealthy else 0.0)
    yield cond
    cordoned = GaugeMetricFamily("mscale_kube_node_cordoned", "1 while the node is cordoned by this agent")
    cordoned.add_metric([], 1.0 if node.cordoned else 0.0)
    yield cordoned
    events = CounterMetricFamily("mscale_kube_events", "Kubernetes Events, by result", labels=["result"])
    events.add_metric(["posted"], node.events_posted)
    events.add_metric(["dropped"], node.events_dropped)
    yield events
    refused = CounterMetricFamily("mscale_kube_cordon_refused", "cordons the circuit breaker refused")
    refused.add_metric([], node.cordon_refused)
    yield refused
    errors = CounterMetricFamily("mscale_kube_api_errors", "failed Kubernetes API calls, by what", labels=["call"])
    for call, n in sorted(node.api_errors.items()):
        errors.add_metric([call], n)
    yield errors
