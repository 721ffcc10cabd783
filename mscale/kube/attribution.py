"""Pod labels on the agent's series: `pod`, `namespace`, `container` from the pod-resources
cache (a GPU's series, by `gpu_uuid`, else `gpu` index) and from the job's own registration
(a job's series, by `job_id` and, where present, `rank`: the pod the hook library read from
the downward API, POD_NAME and POD_NAMESPACE). Added at scrape time to the families the
exporters built; off the cluster (no cache, no job pods) every sample passes unchanged."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.samples import Sample

from mscale.kube.podresources import PodMap, PodRef

SNAPSHOT = "kube_pods"  # AgentState.snapshots key of the latest PodMap
POD_LABELS = PodRef._fields  # namespace, pod, container


def _job_pod(job: Any, rank: str | None, pods: PodMap | None) -> PodRef | None:
    by_rank: Mapping[int, tuple[str, str]] = getattr(job, "pods", None) or {}
    if not by_rank:
        return None
    live = getattr(job, "ranks", None) or {}  # a rank that left may have run in another pod
    by_rank = {r: p for r, p in by_rank.items() if r in live} or by_rank
    if rank is not None and rank.isdigit() and int(rank) in by_rank:
        ns, pod = by_rank[int(rank)]
    elif len(set(by_rank.values())) == 1:
        ns, pod = next(iter(by_rank.values()))
    else:
        return None  # ranks in several pods and the series names none: no guess
    containers = pods.containers_of(ns, pod) if pods is not None else set()
    return PodRef(ns, pod, next(iter(containers)) if len(containers) == 1 else "")


def gpu_pods(state: Any) -> dict[str, PodRef]:
    """gpu_uuid and str(index) -> PodRef, from the cached pod-resources map and the GPU snapshot."""
    pods: PodMap | None = state.snapshots.get(SNAPSHOT)
    if pods is None or not pods.devices:
        return {}
    out: dict[str, PodRef] = {}
    snap = state.snapshots.get("gpu")
    for g in getattr(snap, "gpus", ()):
        ref = pods.devices.get(g.uuid) or pods.devices.get(str(g.index))
        if ref is not None:
            out[g.uuid] = out[str(g.index)] = ref
    return out


def add_pod_labels(families: Iterable[Metric], state: Any) -> Iterable[Metric]:
    pods: PodMap | None = state.snapshots.get(SNAPSHOT)
    by_gpu = {k: ref._asdict() for k, ref in gpu_pods(state).items()}
    jobs = state.jobs
    if not by_gpu and not any(getattr(j, "pods", None) for j in jobs.values()):
        yield from families
        return
    by_job: dict[tuple[str, str | None], dict[str, str] | None] = {}  # one lookup per (job, rank)
    for family in families:
        for i, s in enumerate(family.samples):
            labels = s.labels
            if not labels or "pod" in labels:
                continue
            extra = None
            job_id = labels.get("job_id")
            if job_id is not None and job_id in jobs:
                key = (job_id, labels.get("rank"))
                if key not in by_job:
                    ref = _job_pod(jobs[job_id], key[1], pods)
                    by_job[key] = ref._asdict() if ref is not None else None
                extra = by_job[key]
            if extra is None and by_gpu:
                extra = by_gpu.get(labels.get("gpu_uuid", "")) or by_gpu.get(labels.get("gpu", ""))
            if extra is not None:
                family.samples[i] = Sample(s.name, {**labels, **extra}, *s[2:])  # faster than _replace
        yield family
