"""Kubernetes with NVSentinel: an `ExternalFault` object per GPU fault, NVSentinel's entry door
for an outside system to have a node quarantined, drained and repaired.

The shape follows NVSentinel's published design, ADR-049 "API — ExternalFault (EF)"
(github.com/NVIDIA/NVSentinel docs/designs/049-external-fault.md, commit
0b56ace9ac8fc145e1fe27bdcf863234e8710b34; NVSentinel v1.28.0 docs): a cluster-scoped
`nvsentinel.dgxc.nvidia.com/v1` ExternalFault whose `spec.healthEvent` is a HealthEvent
(data-models/protobufs/health_event.proto, commit 264bfab85e3c490468f9239858fa52bb6b977e3f), in
the JSON its CRDs use (enums by name, `generatedTimestamp` RFC 3339, `metadata` a string map;
the ExternalRemediationRequest CRD, commit 15ca6e309623bb4e49cfc1a79176d29c29379c52). The group,
version and plural are config keys: an installed CRD that differs (earlier drafts used
nvsentinel.nvidia.com/v1alpha1) is matched without a code change.

    apiVersion: nvsentinel.dgxc.nvidia.com/v1
    kind: ExternalFault
    metadata: {name: mscale-NODE-sdc-gpu-..., labels: {app.kubernetes.io/managed-by: mscale-agent, ...}}
    spec:
      healthEvent:
        version: 1, agent: mscale-agent, componentClass: GPU,
        checkName: MscaleGpuSilentDataCorruption | MscaleGpuFatalXid,
        isFatal: true, isHealthy: false, message: ...,
        recommendedAction: COMPONENT_RESET | RESTART_BM | CONTACT_SUPPORT (or CUSTOM, see below),
        errorCode: [GPUSilentDataCorruption] | ["79"],
        entitiesImpacted: [{entityType: GPU_UUID, entityValue: GPU-...}, {entityType: GPU, entityValue: "3"}],
        metadata: {gpuIndex, gpuUuid, faultKind, bootId, jobId, rank, mpuId, standbyGpu, xid, ...},
        generatedTimestamp: ..., nodeName: NODE, processingStrategy: EXECUTE_REMEDIATION, id: ...

Filing creates it (409, already there: filed before, idempotent); undoing deletes it, which is
ADR-049's operator-delete path (the EF closes; a child ExternalRemediationRequest is collected and
its finalizer lifts its taint), done once the GPU was reset and is healthy again. NVSentinel's
admission webhook allows one active EF per node: a second GPU's filing is refused while the first
is open, and retried (the node is being drained anyway). Needs create and delete on
externalfaults (deploy/kubernetes/overlays/remediation). Off by default.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import re
from dataclasses import dataclass
from typing import Any

from mscale.kube.remediation.base import CLEARED, EXISTS, FILED, GONE, FilerContext, FilerSpec, FilingFailed
from mscale.kube.remediation.verdicts import SDC, Fault
from mscale.options import opt

AGENT = "mscale-agent"
CHECKS = {"sdc": "MscaleGpuSilentDataCorruption", "xid": "MscaleGpuFatalXid"}
STRATEGIES = ("EXECUTE_REMEDIATION", "STORE_ONLY")
_DNS = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_FACTS = {"job_id": "jobId", "rank": "rank", "mpu_id": "mpuId", "standby_gpu": "standbyGpu", "xid": "xid"}


@dataclass(frozen=True)
class ExternalFaultSection:
    """[remediation.externalfault]"""

    api_group: str = opt("nvsentinel.dgxc.nvidia.com", "the ExternalFault CRD's API group (NVSentinel ADR-049)")
    api_version: str = opt("v1", "the ExternalFault CRD's version")
    plural: str = opt("externalfaults", "the ExternalFault CRD's plural (its resource name)")
    processing_strategy: str = opt(
        "EXECUTE_REMEDIATION",
        "healthEvent.processingStrategy: act on it, or STORE_ONLY (NVSentinel records, changes nothing)",
        choices=STRATEGIES,
    )
    custom_recommended_action: str = opt(
        "",
        "non-empty: recommendedAction CUSTOM with this customRecommendedAction (e.g. external-remediation); "
        "the agent's own recommendation stays in metadata",
    )

    def check(self, key: str) -> None:
        from mscale.options import ConfigError

        for name in ("api_group", "plural"):
            value = getattr(self, name)
            if not _DNS.fullmatch(value) or len(value) > 253:
                raise ConfigError(f"{key}.{name}: expected a DNS name, got {value!r}")
        if not re.fullmatch(r"v[0-9]+((alpha|beta)[0-9]+)?", self.api_version):
            raise ConfigError(
                f"{key}.api_version: expected a Kubernetes API version (v1, v1alpha1), got {self.api_version!r}"
            )
        if self.custom_recommended_action and not re.fullmatch(r"[A-Za-z0-9._-]{1,63}", self.custom_recommended_action):
            raise ConfigError(
                f"{key}.custom_recommended_action: expected 1-63 of [A-Za-z0-9._-], got {self.custom_recommended_action!r}"
            )


def object_name(node: str, fault: Fault) -> str:
    """mscale-NODE-KIND-UUID, a DNS subdomain of at most 253 characters (hashed when longer)."""
    name = f"mscale-{node}-{fault.fault_id}".lower()
    if len(name) > 253:
        name = name[:236] + "-" + hashlib.sha256(name.encode()).hexdigest()[:16]
    return name


def body(cfg: ExternalFaultSection, node: str, fault: Fault) -> dict[str, Any]:
    """The ExternalFault the agent creates for `fault` on `node`."""
    metadata = {
        "source": AGENT,
        "faultKind": fault.kind,
        "gpuIndex": str(fault.gpu),
        "gpuUuid": fault.gpu_uuid,
        "mscaleRecommendedAction": fault.action,
        **({"bootId": fault.boot_id} if fault.boot_id else {}),
        **{v: fault.facts[k] for k, v in _FACTS.items() if fault.facts.get(k)},
    }
    custom = cfg.custom_recommended_action
    event: dict[str, Any] = {
        "version": 1,
        "agent": AGENT,
        "componentClass": "GPU",
        "checkName": CHECKS[fault.kind],
        "isFatal": True,
        "isHealthy": False,
        "message": f"{fault.message}. Recommended action: {fault.recommended}"[:1024],
        "recommendedAction": "CUSTOM" if custom else fault.action,
        "errorCode": [fault.reason if fault.kind == SDC else fault.facts.get("xid", fault.reason)],
        "entitiesImpacted": [
            {"entityType": "GPU_UUID", "entityValue": fault.gpu_uuid},
            {"entityType": "GPU", "entityValue": str(fault.gpu)},
        ],
        "metadata": metadata,
        "generatedTimestamp": dt.datetime.fromtimestamp(fault.since, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "nodeName": node,
        "processingStrategy": cfg.processing_strategy,
        "id": f"mscale-{fault.fault_id}-{int(fault.since)}",
    }
    if custom:
        event["customRecommendedAction"] = custom
    return {
        "apiVersion": f"{cfg.api_group}/{cfg.api_version}",
        "kind": "ExternalFault",
        "metadata": {
            "name": object_name(node, fault),
            "labels": {
                "app.kubernetes.io/managed-by": AGENT,
                "mscale.io/fault-kind": fault.kind,
                "mscale.io/gpu-uuid": re.sub(r"[^A-Za-z0-9._-]", "-", fault.gpu_uuid)[:63].strip("-._") or "unknown",
            },
        },
        "spec": {"healthEvent": event},
    }


class ExternalFaultFiler:
    name, kinds = "externalfault", ("sdc", "xid")

    def __init__(self, cfg: ExternalFaultSection, ctx: FilerContext) -> None:
        self.cfg, self.node = cfg, ctx.node
        self.kube = ctx.config.kubernetes
        self.api: Any = None

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        async with asyncio.timeout(self.kube.request_timeout_s + 1):
            return await asyncio.to_thread(fn, *args, _request_timeout=self.kube.request_timeout_s, **kwargs)

    async def start(self) -> None:
        from kubernetes import client

        from mscale.kube.node import make_api

        async with asyncio.timeout(self.kube.request_timeout_s + 1):
            core = await asyncio.to_thread(make_api, self.kube)
        self.api = client.CustomObjectsApi(core.api_client)

    async def stop(self) -> None:
        pass

    def _where(self) -> tuple[str, str, str]:
        return self.cfg.api_group, self.cfg.api_version, self.cfg.plural

    async def file(self, fault: Fault) -> str:
        try:
            await self._call(self.api.create_cluster_custom_object, *self._where(), body(self.cfg, self.node, fault))
        except Exception as e:
            if getattr(e, "status", None) == 409:
                return EXISTS
            hint = (
                f" (no {self.cfg.plural}.{self.cfg.api_group}/{self.cfg.api_version} here: is NVSentinel's "
                "ExternalFault CRD installed? remediation.externalfault.api_group, api_version, plural)"
                if getattr(e, "status", None) == 404
                else ""
            )
            raise FilingFailed(f"create ExternalFault: {_why(e)}{hint}", labels=_status(e)) from None
        return FILED

    async def clear(self, fault: Fault) -> str:
        try:
            await self._call(self.api.delete_cluster_custom_object, *self._where(), object_name(self.node, fault))
        except Exception as e:
            if getattr(e, "status", None) == 404:
                return GONE
            raise FilingFailed(f"delete ExternalFault: {_why(e)}", labels=_status(e)) from None
        return CLEARED


def _status(e: Exception) -> dict[str, str]:
    status = getattr(e, "status", None)
    return {"http_status": str(status)} if status is not None else {}


def _why(e: Exception) -> str:
    status = getattr(e, "status", None)
    if status is not None:
        return f"HTTP {status} {getattr(e, 'reason', '')}: {str(getattr(e, 'body', '') or '')[:200]}"
    return f"{type(e).__name__}: {str(e)[:200]}"


def _factory(section: ExternalFaultSection, ctx: FilerContext) -> ExternalFaultFiler:
    if not ctx.config.kubernetes.enabled:
        from mscale.options import ConfigError

        raise ConfigError("remediation.externalfault.enabled: needs kubernetes.enabled = true")
    return ExternalFaultFiler(section, ctx)


SPEC = FilerSpec(
    "externalfault",
    False,
    ExternalFaultSection,
    _factory,
    "with [kubernetes] enabled and NVSentinel installed: file each GPU fault as an NVSentinel ExternalFault",
)
