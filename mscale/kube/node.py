"""The node's view of its GPUs in the Kubernetes API, through the official client:

- the node condition `GPUUnhealthy` (status True while a GPU is failed, or proven by the fuse to
  compute wrong: reason `GPUSilentDataCorruption`; reason from the fault, the recommended action
  in the message), written on a change and at least every heartbeat;
- non-fatal GPU findings as Events on the node;
- remediation (opt-in): cordon (and taint) the node on a fatal fault, with a circuit breaker
  (no more than `max_cordoned_nodes` nodes of the cluster carrying the agents' cordon label),
  undone only once the failed GPUs were reset and then passed `uncordon_healthy_checks`
  consecutive health checks. A node someone else cordoned is left alone.

Blocking calls, each with the request deadline: the service runs them off the event loop.
"""

from __future__ import annotations

import datetime as dt
import itertools
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mscale.kube.settings import CONDITION_TYPE, CORDON_LABEL, TAINT_KEY, KubernetesSection

MERGE_PATCH = "application/strategic-merge-patch+json"
COMPONENT = "mscale-agent"
EVENT_NAMESPACE = "default"  # where the kubelet puts a node's Events
CORDON_REASON_ANNOTATION = "mscale.io/cordon-reason"

# NVIDIA's immediate action per Xid bucket (the Xid table's `action`), said to an operator
ACTIONS = {
    "RESET_GPU": "drain the node's GPU workloads and reset the GPU (nvidia-smi -r), or reboot the node",
    "RESTART_BM": "drain the node and reboot it",
    "CONTACT_SUPPORT": "drain the node and contact the hardware vendor",
    "RESTART_APP": "restart the affected application",
}
LOST_ACTION = "drain the node and reboot it; if the GPU stays lost, reseat or replace it"
DEFAULT_ACTION = "drain the node's GPU workloads and reset the GPU, or reboot the node"
SDC_REASON = "GPUSilentDataCorruption"  # a GPU the fuse proved computes wrong (mscale.kube.remediation)
SDC_SNAPSHOT = "remediation_sdc"  # AgentState.snapshots key of the open SDC verdicts the condition carries


def now_iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def camel(text: str) -> str:
    """A finding's reason code (gpu_ecc_sbe_storm) as a Kubernetes reason (GpuEccSbeStorm)."""
    return "".join(p[:1].upper() + p[1:] for p in re.split(r"[^A-Za-z0-9]+", text) if p)[:128] or "Unknown"


@dataclass(frozen=True)
class Condition:
    unhealthy: bool
    reason: str
    message: str
    failed: frozenset[str] = frozenset()  # UUIDs of the failed GPUs
    healthy: frozenset[str] = frozenset()  # UUIDs of the GPUs in the `healthy` state


def condition_of(snapshot: Any, sdc: Iterable[Any] = ()) -> Condition:
    """The node condition the GPU snapshot calls for. `sdc`: the open silent-data-corruption
    verdicts (mscale.kube.remediation: a GPU the fuse proved at fault, `gpu`, `gpu_uuid`,
    `message`, `recommended`); the probe sees nothing wrong with such a GPU, so it counts as
    failed here and not as healthy until the verdict is undone."""
    gpus = getattr(snapshot, "gpus", ())
    failed = [g for g in gpus if g.health == "failed"]
    sdc = [f for f in sdc if f.gpu_uuid not in {g.uuid for g in failed}]
    bad = frozenset(g.uuid for g in failed) | frozenset(f.gpu_uuid for f in sdc)
    healthy = frozenset(g.uuid for g in gpus if g.health == "healthy") - bad
    if not bad:
        return Condition(False, "GPUsHealthy", "no GPU of this node is failed", healthy=healthy)
    if failed:
        g = failed[0]
        actions = dict(g.xid_actions)
        if g.lost:
            reason, action = "GPULost", LOST_ACTION
        elif g.last_xid is not None and g.last_xid in actions:
            reason, action = f"GPUXid{g.last_xid}", ACTIONS.get(actions[g.last_xid], DEFAULT_ACTION)
        elif g.ecc_dbe_volatile:
            reason, action = "GPUDoubleBitECC", DEFAULT_ACTION
        else:
            reason, action = "GPUFailed", DEFAULT_ACTION
    else:
        reason, action = SDC_REASON, sdc[0].recommended
    parts = [f"GPU {x.index} ({x.uuid}): " + ("; ".join(x.reasons) or "failed") for x in failed]
    parts += [f"GPU {f.gpu} ({f.gpu_uuid}): silent data corruption: {f.message}" for f in sdc]
    message = f"{'; '.join(parts)}. Recommended action: {action}."[:1024]
    return Condition(True, reason, message, bad, healthy)


@dataclass
class NodeStatus:
    """What the writer last did, for the exporter and the tests (read-only outside)."""

    condition: Condition | None = None
    condition_written_at: float = 0.0
    cordoned: bool = False  # by this agent (its label is on the node)
    cordon_gpus: frozenset[str] = frozenset()  # the GPUs that failed while cordoned (empty: adopted, all GPUs)
    healthy_checks: int = 0  # consecutive healthy checks since the failed GPUs came back
    events_posted: int = 0
    events_dropped: int = 0
    cordon_refused: int = 0  # the circuit breaker said no
    api_errors: dict[str, int] = field(default_factory=dict)  # by call


class NodeWriter:
    """One node's condition, Events and cordon. `api` is a kubernetes.client.CoreV1Api."""

    def __init__(self, api: Any, node: str, cfg: KubernetesSection) -> None:
        self.api, self.node, self.cfg = api, node, cfg
        self.status = NodeStatus()
        self._seq = itertools.count()
        self._timeout = cfg.request_timeout_s

    # --- the condition ------------------------------------------------------------------

    def write_condition(self, cond: Condition, now: float) -> bool:
        """Patch the condition if it changed or its heartbeat is due; True if it was written."""
        last = self.status.condition
        same = last is not None and (last.unhealthy, last.reason, last.message) == (
            cond.unhealthy,
            cond.reason,
            cond.message,
        )
        if same and now - self.status.condition_written_at < self.cfg.condition_heartbeat_s:
            return False
        changed = last is None or last.unhealthy != cond.unhealthy
        entry = {
            "type": CONDITION_TYPE,
            "status": "True" if cond.unhealthy else "False",
            "reason": cond.reason,
            "message": cond.message,
            "lastHeartbeatTime": now_iso(now),
        }
        if changed:  # the API server keeps the old transition time when the patch omits it
            entry["lastTransitionTime"] = now_iso(now)
        self.api.patch_node_status(
            self.node,
            {"status": {"conditions": [entry]}},
            _content_type=MERGE_PATCH,
            _request_timeout=self._timeout,
        )
        self.status.condition, self.status.condition_written_at = cond, now
        return True

    # --- Events -------------------------------------------------------------------------

    def post_event(self, reason: str, message: str, *, warning: bool, now: float) -> None:
        from kubernetes import client

        stamp = dt.datetime.fromtimestamp(int(now), dt.UTC)
        event = client.CoreV1Event(
            metadata=client.V1ObjectMeta(name=f"{self.node}.mscale.{int(now * 1e6):x}{next(self._seq)}"),
            involved_object=client.V1ObjectReference(api_version="v1", kind="Node", name=self.node, uid=self.node),
            reason=camel(reason),
            message=message[:1024],
            type="Warning" if warning else "Normal",
            source=client.V1EventSource(component=COMPONENT, host=self.node),
            reporting_component=COMPONENT,
            reporting_instance=self.node,
            first_timestamp=stamp,
            last_timestamp=stamp,
            count=1,
        )
        self.api.create_namespaced_event(EVENT_NAMESPACE, event, _request_timeout=self._timeout)
        self.status.events_posted += 1

    # --- cordon -------------------------------------------------------------------------

    def cordoned_nodes(self) -> list[str]:
        nodes = self.api.list_node(label_selector=f"{CORDON_LABEL}=true", _request_timeout=self._timeout)
        return [n.metadata.name for n in nodes.items]

    def remediate(self, cond: Condition, now: float, all_gpus: frozenset[str] = frozenset()) -> str:
        """Cordon or uncordon as the condition calls for; returns what it did
        (cordoned, refused, uncordoned, waiting, none). `all_gpus`: every GPU's UUID, what an
        adopted cordon (whose cause this process never saw) waits on."""
        if not self.cfg.cordon:
            return "none"
        st = self.status
        if cond.unhealthy:
            st.healthy_checks = 0
            if st.cordoned:
                st.cordon_gpus |= cond.failed
                return "none"
            result = self._cordon(cond, now)
            if result == "cordoned":
                st.cordon_gpus = cond.failed
            return result
        if not st.cordoned:
            return "none"
        # The health model clears a failure only at a GPU reset (or when a lost GPU answers
        # again); then each GPU that failed must pass the health check (state healthy, not
        # merely not failed) this many times in a row.
        if not (st.cordon_gpus or all_gpus) <= cond.healthy:
            st.healthy_checks = 0
            return "waiting"
        st.healthy_checks += 1
        if self.status.healthy_checks < self.cfg.uncordon_healthy_checks:
            return "waiting"
        return self._uncordon()

    def adopt(self) -> None:
        """At start: a cordon this agent made before a restart is still its own."""
        node = self.api.read_node(self.node, _request_timeout=self._timeout)
        labels = node.metadata.labels or {}
        self.status.cordoned = labels.get(CORDON_LABEL) == "true"

    def _cordon(self, cond: Condition, now: float) -> str:
        node = self.api.read_node(self.node, _request_timeout=self._timeout)
        if node.spec.unschedulable and (node.metadata.labels or {}).get(CORDON_LABEL) != "true":
            return "none"  # someone else cordoned it: not ours to undo later
        others = [n for n in self.cordoned_nodes() if n != self.node]
        if len(others) >= self.cfg.max_cordoned_nodes:
            self.status.cordon_refused += 1
            self.post_event(
                "CordonRefused",
                f"circuit breaker: {len(others)} node(s) already cordoned by mscale "
                f"(kubernetes.max_cordoned_nodes = {self.cfg.max_cordoned_nodes}); not cordoning: {cond.message}",
                warning=True,
                now=now,
            )
            return "refused"
        spec: dict[str, Any] = {"unschedulable": True}
        if self.cfg.taint:
            taints = [t.to_dict() for t in (node.spec.taints or []) if t.key != TAINT_KEY]
            spec["taints"] = [_plain(t) for t in taints] + [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}]
        body = {
            "metadata": {
                "labels": {CORDON_LABEL: "true"},
                "annotations": {CORDON_REASON_ANNOTATION: f"{cond.reason}: {cond.message}"[:1024]},
                "resourceVersion": node.metadata.resource_version,
            },
            "spec": spec,
        }
        self.api.patch_node(self.node, body, _content_type=MERGE_PATCH, _request_timeout=self._timeout)
        self.status.cordoned = True
        return "cordoned"

    def _uncordon(self) -> str:
        node = self.api.read_node(self.node, _request_timeout=self._timeout)
        spec: dict[str, Any] = {"unschedulable": None}
        if any(t.key == TAINT_KEY for t in node.spec.taints or []):
            spec["taints"] = [_plain(t.to_dict()) for t in node.spec.taints if t.key != TAINT_KEY]
        body = {
            "metadata": {
                "labels": {CORDON_LABEL: None},
                "annotations": {CORDON_REASON_ANNOTATION: None},
                "resourceVersion": node.metadata.resource_version,
            },
            "spec": spec,
        }
        self.api.patch_node(self.node, body, _content_type=MERGE_PATCH, _request_timeout=self._timeout)
        self.status.cordoned, self.status.healthy_checks, self.status.cordon_gpus = False, 0, frozenset()
        return "uncordoned"


def _plain(taint: dict) -> dict:
    """A V1Taint's dict in the API's field names, without empty fields."""
    names = {"time_added": "timeAdded"}
    return {names.get(k, k): v for k, v in taint.items() if v is not None}


def make_api(cfg: KubernetesSection) -> Any:
    """CoreV1Api: in-cluster from the service account, or `api_server` (tests, out-of-cluster)."""
    from kubernetes import client, config

    if cfg.api_server:
        conf = client.Configuration(host=cfg.api_server)
    else:
        conf = client.Configuration()
        config.load_incluster_config(client_configuration=conf)
    conf.retries = 0  # the agent retries on its own schedule
    return client.CoreV1Api(client.ApiClient(conf))
