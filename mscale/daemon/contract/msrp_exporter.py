"""MSRP per job: what the job's micro-probes measured on each GPU it uses, and what each MPU
achieves there (state.snapshots["contract"], fed by the job's {"type": "msrp"} messages).

    mscale_msrp_memory_bandwidth_bytes_per_second{job_id,rank,gpu}   effective copy bandwidth
    mscale_msrp_matmul_flops{job_id,rank,gpu,dtype}                  dense matmul FLOP/s
    mscale_msrp_measured_timestamp_seconds{job_id,rank,gpu}          when the probes last ran
    mscale_mpu_achieved_flops{job_id,rank,mpu_id}                    FLOP/s the MPU achieves per step
    mscale_mpu_step_flops{job_id,rank,mpu_id}                        FLOPs of one training step of the MPU
    mscale_mpu_memory_bytes{job_id,rank,mpu_id}                      parameters, gradients, optimizer state
    mscale_mpu_compute_density{job_id,rank,mpu_id}                   achieved TFLOP/s per GB of that memory
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from mscale.daemon.jobs import sample_value as value
from mscale.daemon.state import AgentState


def density(mpu: dict[str, Any]) -> float | None:
    """Achieved TFLOP/s per GB of the MPU's memory (the profile catalogue's unit)."""
    flops, memory = value(mpu.get("achieved_flops")), value(mpu.get("memory_bytes"))
    if not (flops >= 0 and memory > 0):
        return None
    return (flops / 1e12) / (memory / 1e9)


def collect(state: AgentState) -> Iterable[Metric]:
    snap = state.snapshots.get("contract")
    gpu_labels = ["job_id", "rank", "gpu"]
    mpu_labels = ["job_id", "rank", "mpu_id"]
    bandwidth = GaugeMetricFamily(
        "mscale_msrp_memory_bandwidth_bytes_per_second",
        "effective memory bandwidth the job's micro-probe measured on the GPU (bytes read plus written per second)",
        labels=gpu_labels,
    )
    matmul = GaugeMetricFamily(
        "mscale_msrp_matmul_flops",
        "dense matmul throughput (FLOP/s) the job's micro-probe measured on the GPU, in its dtype",
        labels=[*gpu_labels, "dtype"],
    )
    measured = GaugeMetricFamily(
        "mscale_msrp_measured_timestamp_seconds", "Unix time the job's MSRP micro-probes last ran", labels=gpu_labels
    )
    achieved = GaugeMetricFamily(
        "mscale_mpu_achieved_flops", "FLOP/s the MPU achieves over its forward and backward", labels=mpu_labels
    )
    step = GaugeMetricFamily(
        "mscale_mpu_step_flops", "FLOPs of one training step of the MPU (3x its counted forward)", labels=mpu_labels
    )
    memory = GaugeMetricFamily(
        "mscale_mpu_memory_bytes", "bytes the MPU holds: parameters, gradients, optimizer state", labels=mpu_labels
    )
    dens = GaugeMetricFamily(
        "mscale_mpu_compute_density",
        "achieved TFLOP/s per GB of the MPU's memory, the unit of the contract's compute profile",
        labels=mpu_labels,
    )
    for r in getattr(snap, "records", ()):
        if not r.msrp:
            continue
        rank = str(r.rank)
        for gpu, d in sorted(r.msrp.get("gpus", {}).items()):
            labels = [r.job_id, rank, gpu]
            if "bandwidth_bytes_per_s" in d:
                bandwidth.add_metric(labels, value(d["bandwidth_bytes_per_s"]))
            if "matmul_flops" in d:
                matmul.add_metric([*labels, str(d.get("dtype", ""))], value(d["matmul_flops"]))
            if "measured_at" in d:
                measured.add_metric(labels, value(d["measured_at"]))
        for mpu_id, m in sorted(r.msrp.get("mpus", {}).items()):
            labels = [r.job_id, rank, mpu_id]
            if "achieved_flops" in m:
                achieved.add_metric(labels, value(m["achieved_flops"]))
            if "flops_per_step" in m:
                step.add_metric(labels, value(m["flops_per_step"]))
            if "memory_bytes" in m:
                memory.add_metric(labels, value(m["memory_bytes"]))
            d = density(m)
            if d is not None:
                dens.add_metric(labels, d)
    yield from (bandwidth, matmul, measured, achieved, step, memory, dens)
