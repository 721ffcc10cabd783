"""Alert definitions: the expression, the words, the runbook. Numbers come from params.yaml.

Expressions are `string.Template`s: `$agent`/`$nodes` are the selectors, `$rate`/`$event`
the windows, and every key of the alert's own params entry (`$celsius`, `$score`, ...) is
available, plus `$xids` (a regex of the fatal Xid codes). A token left unreplaced is an error.

`component` classifies an alert for Alertmanager's inhibition rules:
  gpu       a GPU's hardware (critical ones inhibit training alerts on the same gpu_uuid)
  training  a job's MPUs, loss, CUDA activity (carry job_id; MPU alerts carry gpu_uuid)
  snapshot  snapshots of a job
  probe     what the agent's probes report about themselves and its jobs (inhibited by agent down)
  agent     the agent's target;  node: every target of a node (inhibits all on the node)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Alert:
    name: str
    component: str
    expr: str
    summary: str
    description: str
    runbook: str  # markdown for its entry in docs/runbooks.md


def mpu_with_gpu(expr: str) -> str:
    """Attach the MPU's gpu/gpu_uuid (from mscale_mpu_info, per rank: each rank's MPU is on its
    own GPU) so GPU alerts can inhibit it; the `or` keeps the alert when the info series is missing."""
    info = "mscale_mpu_info{$agent}"
    return (
        f"(({expr}) * on (instance, job_id, rank, mpu_id) group_left (gpu, gpu_uuid) {info}) "
        f"or (({expr}) unless on (instance, job_id, rank, mpu_id) {info})"
    )


ALERTS: tuple[Alert, ...] = (
    # --- GPU hardware -----------------------------------------------------------------
    Alert(
        "MscaleGpuFatalXid",
        "gpu",
        'gpu:mscale_gpu_xid_errors:increase$event{xid=~"$xids"} > 0',
        "GPU {{ $labels.gpu }} on {{ $labels.node }} reported fatal Xid {{ $labels.xid }}",
        "GPU {{ $labels.gpu }} ({{ $labels.gpu_uuid }}) on node {{ $labels.node }} reported Xid "
        "{{ $labels.xid }}, which the driver only raises for a fault the GPU cannot recover from "
        "without a reset. The agent swaps the MPUs bound to it to a standby GPU.",
        """A fatal Xid (the codes are in `params.yaml`, `alerts.MscaleGpuFatalXid.xids`, and match
the agent's [Xid table](xid.md)) means the GPU needs a reset or replacement.

1. Check the agent acted: `mscale status` on the node shows the GPU `failed` and its MPUs moved
   (fuse level `L1`); `GET /api/v1/events` lists the `heal_action` events.
2. Read the kernel log for the Xid (`journalctl -k | grep -i xid`) and the driver's reason.
3. Drain the node from the scheduler when the job can move; then reset the GPU
   (`nvidia-smi -r -i <gpu>`) or, for Xid 79 (fallen off the bus), reboot and file an RMA if
   it recurs.""",
    ),
    Alert(
        "MscaleGpuEccDoubleBit",
        "gpu",
        'gpu:mscale_gpu_ecc_errors:increase$event{type="double_bit"} > 0',
        "GPU {{ $labels.gpu }} on {{ $labels.node }} had an uncorrectable (double-bit) ECC error",
        "GPU {{ $labels.gpu }} ({{ $labels.gpu_uuid }}) on node {{ $labels.node }} counted a "
        "double-bit ECC error: memory contents were lost. Results computed on it since are suspect.",
        """An uncorrectable ECC error corrupts whatever was in that memory: weights, activations or
optimizer state. The agent marks the GPU failed and moves its MPUs (restoring the last verified
snapshot when the weights themselves fail their checksums).

1. `mscale status`: the GPU is `failed`, its MPUs are off it.
2. `nvidia-smi -q -d ECC,ROW_REMAPPER -i <gpu>`: a pending row remap needs a GPU reset to
   apply; a failed remap means the GPU must be replaced.
3. Reset the GPU in a maintenance window; if the count rises again, replace it.""",
    ),
    Alert(
        "MscaleGpuLost",
        "gpu",
        "mscale_gpu_lost{$agent} == 1",
        "GPU {{ $labels.gpu }} on {{ $labels.node }} is lost (fallen off the bus)",
        "The driver cannot reach GPU {{ $labels.gpu }} ({{ $labels.gpu_uuid }}) on node "
        "{{ $labels.node }}. Every process using it is stuck or dead.",
        """NVML reports the GPU as lost: it no longer answers on PCIe (usually with Xid 79).

1. `mscale status` shows which MPUs were bound to it and where the agent moved them.
2. `nvidia-smi` on the node: the GPU is missing or shows `ERR!`; `lspci | grep -i nvidia`.
3. Only a reboot (often a power cycle) brings it back. Drain the node first; if it recurs,
   check power and cooling, then RMA.""",
    ),
    Alert(
        "MscaleGpuSilentDataCorruption",
        "gpu",
        'mscale_remediation_gpu_fault{$agent, kind="sdc"} == 1',
        "GPU {{ $labels.gpu }} on {{ $labels.node }} computes wrong (silent data corruption)",
        "The fuse proved GPU {{ $labels.gpu }} ({{ $labels.gpu_uuid }}) on node {{ $labels.node }} at "
        "fault: an MPU's outputs failed their checks on it and came clean on a standby GPU. The agent "
        "filed it for node remediation ({{ $labels.action }}); it stands until the GPU is reset and healthy.",
        """The GPU reports nothing wrong, yet computes wrong: a job's MPU failed its checksums there
and came clean on the standby it was swapped to (same model, same data). The job goes on, on
the standby; the next job would land on the same GPU.

1. `GET /api/v1/events` reason `gpu_fault_verdict` names the job, rank, MPU and standby; the
   Healing dashboard's row Remediation hand-off shows what was filed where
   (`mscale_remediation_filed`: the `GPUUnhealthy` node condition with reason
   `GPUSilentDataCorruption`, an NVSentinel ExternalFault, the command hook).
2. Drain the GPU's workloads and reset it (`nvidia-smi -r -i <gpu>`), or reboot the node, then run
   its diagnostics (`dcgmi diag -r 3`). The agent undoes its filings once it saw the reset and the
   GPU passed `remediation.clear_healthy_checks` health checks.
3. It recurs after a reset: replace the GPU (RMA); quote the `gpu_fault_verdict` events.""",
    ),
    Alert(
        "MscaleGpuTemperatureHigh",
        "gpu",
        "mscale_gpu_temperature_celsius{$agent} >= $celsius",
        "GPU {{ $labels.gpu }} on {{ $labels.node }} is at {{ $value }} C",
        "GPU {{ $labels.gpu }} ({{ $labels.gpu_uuid }}) on node {{ $labels.node }} has been at or "
        "above $celsius C for $for; it will throttle its clocks and slow the whole job.",
        """The GPU runs hot enough to throttle (the GPU node dashboard shows its clock-throttle
reasons). One slow GPU slows every rank of a synchronous job.

1. GPU node dashboard: is it one GPU (its fan, its heatsink, its slot) or the whole node
   (inlet temperature, chassis fans, data-centre cooling)?
2. `nvidia-smi -q -d TEMPERATURE,PERFORMANCE -i <gpu>`.
3. One GPU: schedule maintenance. Whole node or rack: call facilities.""",
    ),
    Alert(
        "MscaleGpuEccSingleBitStorm",
        "gpu",
        'rate(mscale_gpu_ecc_errors_total{$agent,type="single_bit",counter="volatile"}[$rate]) * 3600 > $per_hour',
        "GPU {{ $labels.gpu }} on {{ $labels.node }}: single-bit ECC storm",
        "GPU {{ $labels.gpu }} ({{ $labels.gpu_uuid }}) on node {{ $labels.node }} corrects more "
        "than $per_hour single-bit ECC errors per hour; memory is degrading and double-bit errors "
        "tend to follow.",
        """Corrected errors cost nothing by themselves, but a storm of them foretells an
uncorrectable one. The agent marks the GPU `degraded`.

1. `nvidia-smi -q -d ECC,ROW_REMAPPER -i <gpu>`: are rows being remapped?
2. Plan to move the job off the GPU at the next snapshot; reset it to apply pending remaps.
3. If the rate returns after a reset, replace the GPU.""",
    ),
    Alert(
        "MscaleGpuNvlinkDown",
        "gpu",
        "mscale_gpu_nvlink_up{$agent} == 0",
        "GPU {{ $labels.gpu }} on {{ $labels.node }}: NVLink {{ $labels.link }} is down",
        "NVLink {{ $labels.link }} of GPU {{ $labels.gpu }} ({{ $labels.gpu_uuid }}) on node "
        "{{ $labels.node }} is inactive; collectives fall back to slower paths or fail.",
        """A down NVLink halves (or worse) the bandwidth of collectives through that GPU and
often comes with Xid 74.

1. GPU node dashboard, NVLink panels: one link or all of them, error counters rising?
2. `nvidia-smi nvlink -s -i <gpu>` and `nvidia-smi nvlink -e -i <gpu>`.
3. A GPU reset may bring the link back; a link that stays down needs the board serviced.""",
    ),
    Alert(
        "MscaleGpuDegraded",
        "gpu",
        'mscale_gpu_health{$agent,state="degraded"} == 1',
        "GPU {{ $labels.gpu }} on {{ $labels.node }} is degraded",
        "The agent's health model rates GPU {{ $labels.gpu }} ({{ $labels.gpu_uuid }}) on node "
        "{{ $labels.node }} degraded (temperature, corrected-error rate, NVLink or PCIe replays).",
        """Degraded is a warning sign, not a failure: the GPU still computes correctly.

1. `curl -s <agent>/api/v1/gpus` lists the GPU's health reasons.
2. Follow the runbook of the matching, more specific alert if one fires too.
3. Otherwise watch the GPU node dashboard; no action is needed while it stays degraded only.""",
    ),
    Alert(
        "MscaleGpuPcieReplayStorm",
        "gpu",
        "rate(mscale_gpu_pcie_replays_total{$agent}[$rate]) * 60 > $per_minute",
        "GPU {{ $labels.gpu }} on {{ $labels.node }}: PCIe replay storm",
        "GPU {{ $labels.gpu }} ({{ $labels.gpu_uuid }}) on node {{ $labels.node }} replays more "
        "than $per_minute PCIe transactions per minute: the link is noisy, host transfers slow down.",
        """PCIe replays are retransmissions after link errors.

1. GPU node dashboard, PCIe panel: replays and throughput of this GPU against its neighbours.
2. `nvidia-smi -q -d PCIE -i <gpu>`: link generation and width (a link trained down to a lower
   width or generation points at the riser or the slot).
3. Reseat or replace the riser in a maintenance window.""",
    ),
    # --- training ---------------------------------------------------------------------
    Alert(
        "MscaleMpuHealthLow",
        "training",
        "job_mpu:mpu_health_score:min < $score",
        "MPU {{ $labels.mpu }} ({{ $labels.mpu_id }}) of job {{ $labels.job_id }} health {{ $value }}",
        "The health score of MPU {{ $labels.mpu }} ({{ $labels.mpu_id }}) of job {{ $labels.job_id }} "
        "on node {{ $labels.node }} has been below $score for $for: it is slow against its own "
        "baseline, failing checksums, short of memory or on an unhealthy GPU.",
        """Below 60 means act before it breaks. The score (0-100) falls with latency against the
MPU's own baseline, checksum failures, memory pressure and the health of its GPU.

1. MPU health dashboard: which term dropped (latency, checksums, the GPU)?
2. A GPU alert on the same `gpu_uuid` inhibits this one: the GPU is the cause, follow its runbook.
3. Latency alone: look for a co-located process or a throttling GPU (GPU node dashboard).
   The fuse escalates by itself if checksums keep failing.""",
    ),
    Alert(
        "MscaleChecksumFailures",
        "training",
        mpu_with_gpu("increase(mscale_mpu_checksum_failures_total{$agent}[$event]) > 0"),
        "MPU {{ $labels.mpu_id }} of job {{ $labels.job_id }} failed its output checksums",
        "MPU {{ $labels.mpu_id }} of job {{ $labels.job_id }} on node {{ $labels.node }} produced "
        "outputs that failed the ABFT or replay checksum {{ $value }} times in $event: silent data "
        "corruption on its GPU.",
        """The hook library's checksums caught outputs that do not match what the inputs and
weights predict. The fuse swaps the MPU to a standby GPU after 3 failures in a row (L1).

1. MPU health dashboard: fuse level of the MPU; an L1 swap should follow.
2. `mscale status`: the GPU the MPU ran on; check that GPU's ECC and Xid panels.
3. Repeated failures on several GPUs of one node point at the node (power, memory): drain it.""",
    ),
    Alert(
        "MscaleFuseL2Engaged",
        "training",
        mpu_with_gpu("mscale_fuse_level{$agent} == 2"),
        "MPU {{ $labels.mpu_id }} of job {{ $labels.job_id }} runs degraded (fuse L2)",
        "MPU {{ $labels.mpu_id }} of job {{ $labels.job_id }} on node {{ $labels.node }} kept "
        "failing after a swap; it now runs degraded (fallback device or precision, reduced input "
        "resolution, raised clip threshold). Training continues at reduced quality for this modality.",
        """L2 modality degradation: the standby failed too, or no healthy standby was left.

1. MPU health dashboard: when the fuse moved and which GPUs the MPU used.
2. Find out why no standby was healthy: GPU alerts on the node, `mscale status`.
3. Free or repair a GPU; the fuse returns to healthy after a clean stretch of steps. If the
   job must keep full quality, stop it at the next snapshot and restart it elsewhere.""",
    ),
    Alert(
        "MscaleFuseL3Engaged",
        "training",
        mpu_with_gpu("mscale_fuse_level{$agent} >= 3"),
        "MPU {{ $labels.mpu_id }} of job {{ $labels.job_id }} is being distilled (fuse L3)",
        "MPU {{ $labels.mpu_id }} of job {{ $labels.job_id }} on node {{ $labels.node }} keeps "
        "failing even degraded; the text MPU now supervises it through a distillation term.",
        """L3 cross-modal distillation is the last level: the modality is being held up by the
text model, and every step that stays at L3 drifts further from the undisturbed run.

1. Act now: find the failing hardware (GPU alerts, `mscale status`, MPU health dashboard).
2. Plan to stop the job at its next verified snapshot and restart it on healthy GPUs; snapshots
   restore bitwise, so no work is lost beyond the last snapshot.""",
    ),
    Alert(
        "MscaleMpuSwapped",
        "training",
        "increase(mpu_drift_count_total{$agent}[$event]) > 0",
        "MPU {{ $labels.mpu_id }} of job {{ $labels.job_id }} was moved to another GPU",
        "The fuse moved MPU {{ $labels.mpu_id }} of job {{ $labels.job_id }} on node "
        "{{ $labels.node }} to a standby GPU (L1) {{ $value }} times in $event.",
        """An L1 swap healed a fault without losing a step; this is for the record.

1. Healing dashboard: the swap and what triggered it.
2. Swaps away from the same GPU again and again: that GPU is failing, take it out of service.""",
    ),
    Alert(
        "MscaleStragglerMpu",
        "training",
        "(job_rank_mpu:mscale_mpu_latency:ratio_to_job_median >= $ratio"
        " and (job_rank_mpu:mscale_mpu_latency_seconds:median$straggler"
        " - on (job_id, mpu_id, phase) group_left ()"
        " quantile by (job_id, mpu_id, phase) (0.5, job_rank_mpu:mscale_mpu_latency_seconds:median$straggler))"
        " >= $min_excess_s)"
        " * on (instance, job_id, rank, mpu_id) group_left (mpu, gpu, gpu_uuid) mscale_mpu_info{$agent}",
        "MPU {{ $labels.mpu }} ({{ $labels.mpu_id }}) of job {{ $labels.job_id }} rank {{ $labels.rank }} "
        "is a straggler ({{ $value | humanize }}x the job's median {{ $labels.phase }})",
        "The {{ $labels.phase }} of MPU {{ $labels.mpu }} ({{ $labels.mpu_id }}) on rank {{ $labels.rank }} "
        "(local rank {{ $labels.local_rank }}, GPU {{ $labels.gpu }} {{ $labels.gpu_uuid }}, node "
        "{{ $labels.node }}) of job {{ $labels.job_id }} has taken at least $ratio times the median of "
        "the same MPU on the job's ranks over $straggler, for $for: every synchronous step waits for it.",
        """One MPU on one GPU is slower than the same MPU on the job's other ranks, on every node
Prometheus sees (the recording rule `job_rank_mpu:mscale_mpu_latency:ratio_to_job_median`). The
other ranks wait for it in every gradient all-reduce: the whole job runs at its pace.

1. Training dashboard, row Stragglers: the ratio per rank and MPU, and the agent's own verdicts
   (`mscale_straggler`, `GET /api/v1/events` reason `straggler`) for the ranks on one node.
2. The GPU: `nvidia-smi -q -d PERFORMANCE,CLOCK,TEMPERATURE -i <gpu>` on the node: clocks
   throttled (power, thermal), a PCIe link trained down, ECC retirements; the GPU dashboard's
   temperature and power for that GPU against its neighbours.
3. Only one MPU slow while the rank's others are not: its input (this rank's shard of that
   modality, larger images or longer audio), or the kernels it alone uses.
4. Persistent and the GPU at fault: move the MPU to a standby GPU. The healing policy does it
   (an L1 swap) only where the operator's policy maps the `straggler` reason to `l1_swap`
   ([healing.md](healing.md)); by default the agent reports.""",
    ),
    Alert(
        "MscaleStragglerRank",
        "training",
        "job_rank:mscale_job_rank_compute:ratio_to_job_median >= $ratio"
        " and (job_rank:mscale_job_rank_compute_seconds:median$straggler"
        " - on (job_id) group_left () quantile by (job_id) (0.5, job_rank:mscale_job_rank_compute_seconds:median$straggler))"
        " >= $min_excess_s",
        "Rank {{ $labels.rank }} of job {{ $labels.job_id }} is a straggler "
        "({{ $value | humanize }}x the job's median compute time)",
        "Rank {{ $labels.rank }} (local rank {{ $labels.local_rank }}, node {{ $labels.node }}) of job "
        "{{ $labels.job_id }} has computed for at least $ratio times the median of the job's ranks over "
        "$straggler, for $for: every synchronous step waits for it.",
        """A rank's compute time (its MPUs' forward and backward, `mscale_job_rank_compute_seconds`) is
above the job's median on every node Prometheus sees. The step's wall time cannot show it: in
synchronous data parallel every rank waits for the slowest in the all-reduce.

1. MscaleStragglerMpu names the MPU when one stands out; without it the whole rank is slow: the
   GPU (clocks, throttling, see that alert), the host (CPU contention from the data loader,
   `mscale_contract_compliant`, NUMA placement), or a larger share of the data.
2. Training dashboard, row Stragglers: since when, and whether it moves between ranks (input)
   or stays on one GPU (hardware).""",
    ),
    Alert(
        "MscaleMpuDensityDeviation",
        "training",
        "mscale_density_recommendation{$agent} == 1",
        "MPU {{ $labels.mpu_id }} of job {{ $labels.job_id }}: compute density off its profile, "
        "recommended {{ $labels.recommended }} ({{ $labels.direction }})",
        "The compute density of MPU {{ $labels.mpu_id }} of job {{ $labels.job_id }} on node "
        "{{ $labels.node }} (GPU {{ $labels.gpu }}) has deviated from its contract's profile "
        "{{ $labels.profile }} for the agent's window; the profile nearest to what it achieves is "
        "{{ $labels.recommended }}. Direction hold: a scale-up is withheld because the GPU is at or "
        "above the thermal limit.",
        """The agent's density guard compares each MPU's achieved TFLOP/s per GB of its memory with
the compute profile its resource contract names ([contracts.md](contracts.md)). This alert is
for the scheduler and the job's owner; nothing is changed by the agent.

1. `mscale contract status JOB` and `GET /api/v1/events` (reason `density_deviation`): the
   measured density, the profile, the recommendation and, for `hold`, the GPU temperature.
2. Direction `up`: the MPU does more work per GB than its profile expects; give it the
   recommended profile (more compute) at the next reschedule. `down`: it is starved (memory- or
   input-bound): check its data loader's compliance (`mscale_contract_compliant`) and the
   GPU's clocks before moving it to a lighter profile.
3. Direction `hold`: cool the GPU first (MscaleGpuTemperatureHigh, airflow); the
   recommendation follows once it is below `contract.thermal_limit_c`.""",
    ),
    Alert(
        "MscaleCmsaClipHigh",
        "training",
        "cmsa_clip_ratio{$agent} > $ratio",
        "MPU {{ $labels.mpu_id }} of job {{ $labels.job_id }}: gradients clipped in most steps",
        "CMSA clipped the gradients of MPU {{ $labels.mpu_id }} of job {{ $labels.job_id }} in "
        "more than $ratio of steps for $for: its learning is throttled.",
        """Per-MPU clipping should be the exception. Clipping most steps means the MPU's gradients
are far noisier than the others' (bad data for that modality, a learning rate too high for it,
or a fuse at L2 raising the threshold).

1. Training stability dashboard: gradient norm of the MPU against the others.
2. Check the modality's data pipeline and its learning-rate multiplier.""",
    ),
    Alert(
        "MscaleLossNonFinite",
        "training",
        'job:mscale_job_findings:increase$event{reason="loss_nonfinite"} > 0',
        "Job {{ $labels.job_id }} produced a NaN or infinite loss",
        "Job {{ $labels.job_id }} on node {{ $labels.node }} computed a non-finite loss {{ $value }} times "
        "in $event (reported by {{ $labels.source }}). The healing engine rolls back to the last good "
        "snapshot and skips the batch; the agent's events (GET /api/v1/events) give the steps.",
        """A NaN or Inf loss must never reach the weights. The engine rolls back and skips the
offending batch.

1. Healing dashboard: a rollback follows each NaN; if not, the job is unprotected, stop it.
2. Repeated NaNs: the batch indices in the events (`GET /api/v1/events`) point at bad samples;
   otherwise lower the learning rate or look for a failing GPU (checksum alerts).""",
    ),
    Alert(
        "MscaleLossSpike",
        "training",
        'job:mscale_job_findings:increase$event{reason=~"loss_spike_action|loss_jump"} > 0',
        "Loss spike in job {{ $labels.job_id }}",
        "The loss of job {{ $labels.job_id }} on node {{ $labels.node }} jumped beyond the action "
        "threshold ({{ $labels.reason }}) {{ $value }} times in $event; the healing engine cooled the "
        "learning rate. The agent's events (GET /api/v1/events) give the steps.",
        """A spike beyond the action threshold (10 sigma above the loss's trend-following baseline by default). The
engine multiplies the LR by 0.1 for a cooling window, and rolls back if the spike persists.

1. Training stability dashboard: loss against its rolling band, gradient norm per MPU: which
   MPU's gradients led the spike?
2. Spikes that recur at the same data position point at bad samples.""",
    ),
    Alert(
        "MscaleTrainingHang",
        "training",
        "mscale_cuda_hang{$agent} == 1",
        "Job {{ $labels.job_id }} (pid {{ $labels.pid }}) is hung",
        "Training process {{ $labels.pid }} of job {{ $labels.job_id }} on node {{ $labels.node }} "
        "is alive but has launched no CUDA kernel (or has been blocked in one synchronise call) "
        "for longer than the hang timeout.",
        """Seen by the eBPF probe on the CUDA driver: no launches, or a synchronise call that never
returns. Usually a collective waiting for a dead or slow peer rank, or a deadlock.

1. Which rank stopped first: compare the job's ranks on the training stability dashboard.
2. `py-spy dump --pid <pid>` shows where the Python stack waits.
3. A peer on a failed GPU: follow that GPU's alert. Otherwise restart the job from its last
   snapshot.""",
    ),
    Alert(
        "MscaleSyncStall",
        "training",
        "mscale_cuda_sync_blocked_ratio{$agent} > $ratio",
        "Job {{ $labels.job_id }} (pid {{ $labels.pid }}) spends most of its time in CUDA synchronise",
        "Process {{ $labels.pid }} of job {{ $labels.job_id }} on node {{ $labels.node }} has been "
        "blocked in cuStreamSynchronize/cuCtxSynchronize for more than $ratio of wall time for $for: "
        "the GPU idles while the host waits.",
        """An implicit synchronisation (`.item()`, `.cpu()`, a blocking copy, a debug print of a
tensor) in the training loop serialises host and GPU.

1. `torch.profiler` on a few steps: look for synchronise calls outside the optimizer step.
2. Remove the host reads from the hot loop or make them asynchronous.""",
    ),
    # --- snapshots --------------------------------------------------------------------
    Alert(
        "MscaleSnapshotFailing",
        "snapshot",
        "increase(mscale_snapshot_failures_total{$agent}[$event]) > 0",
        "Job {{ $labels.job_id }}: snapshots are failing",
        "Job {{ $labels.job_id }} on node {{ $labels.node }} failed to write or verify a snapshot "
        "{{ $value }} times in $event. Rollback and L1 restores fall back to older state.",
        """Without fresh snapshots a rollback loses more steps and an L1 restore of suspect
weights is impossible.

1. `GET /api/v1/events`: the `snapshot_failed` events give the reason (disk full, I/O error,
   checksum mismatch on verify).
2. `df -h` on the snapshot directory; `mscale snapshot verify DIR`.""",
    ),
    Alert(
        "MscaleSnapshotStale",
        "snapshot",
        "time() - mscale_snapshot_last_success_timestamp_seconds{$agent} > $max_age_s",
        "Job {{ $labels.job_id }}: last good snapshot is old",
        "The last snapshot of job {{ $labels.job_id }} on node {{ $labels.node }} that succeeded is "
        "older than $max_age_s seconds.",
        """A stale snapshot bounds how much work a rollback throws away.

1. Is the job still stepping (training stability dashboard)? A hung job takes no snapshots:
   see MscaleTrainingHang.
2. Otherwise see MscaleSnapshotFailing, and check the snapshot interval in the job's config.""",
    ),
    # --- the agent and its probes ------------------------------------------------------
    Alert(
        "MscaleJobMetricsAbsent",
        "probe",
        "(mscale_job_up{$agent} == 0) or (mscale_job_up{$agent} == 1 unless on (instance, job_id) "
        "(increase(mscale_job_reports_total{$agent}[$rate]) > 0))",
        "Job {{ $labels.job_id }} (rank {{ $labels.rank }}) is registered but reports no metrics",
        "Job {{ $labels.job_id }} (rank {{ $labels.rank }}) registered with the agent on node "
        "{{ $labels.node }}, but no step report has come from it for $rate and $for: its link to the "
        "agent is down or it stopped stepping.",
        """The hook library registered the job, but its per-step reports are not arriving.

1. `mscale status`: is the job connected (`mscale_job_up`), what step did it report last?
2. The job's log: reconnect attempts of the hook library (it keeps training and guarding
   in-process while the agent is unreachable).
3. Reports dropped by the job's bounded queue show in `mscale_job_reports_dropped_total`, messages
   the agent refused in `mscale_refused_messages_total`.""",
    ),
    Alert(
        "MscaleProbeDown",
        "probe",
        "mscale_probe_up{$agent} == 0",
        "Probe {{ $labels.probe }} of the agent on {{ $labels.node }} is down",
        "The {{ $labels.probe }} probe of the agent on node {{ $labels.node }} has failed or timed "
        "out for $for; the metrics it feeds are stale.",
        """The agent isolates a failing probe and keeps the others running.

1. `curl -s <agent>/api/v1/probes` gives the probe's last error.
2. `journalctl -u mscale-agent | grep <probe>`.
3. `ebpf` down usually means missing capabilities (CAP_BPF, CAP_PERFMON) or kernel headers;
   `gpu` down means NVML (or dcgm-exporter) does not answer.""",
    ),
    Alert(
        "MscaleAgentDown",
        "agent",
        "up{$agent} == 0",
        "The mscale agent on {{ $labels.node }} is down",
        "Prometheus cannot scrape the mscale agent at {{ $labels.instance }} (node {{ $labels.node }}) "
        "for $for: nothing on that node is watched or healed.",
        """Its probe alerts are inhibited while it is down.

1. `systemctl status mscale-agent` on the node; `journalctl -u mscale-agent -n 100`.
2. A bad configuration exits with status 2 and names the key; fix `/etc/mscale/agent.toml`.
3. Training jobs keep running and guarding in-process; they reconnect when the agent is back.""",
    ),
    Alert(
        "MscaleNodeDown",
        "node",
        "max by (node) (up{$nodes}) == 0",
        "Node {{ $labels.node }} is down",
        "No target of node {{ $labels.node }} (agent, node_exporter) has answered Prometheus for "
        "$for. Every other alert of the node is inhibited.",
        """The whole node is unreachable: powered off, kernel panic, or network lost.

1. Out-of-band console (BMC): is it up?
2. Its jobs have lost their ranks; the scheduler should restart them from their last snapshot
   on other nodes.""",
    ),
)
