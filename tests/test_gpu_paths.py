"""The CUDA paths issue 13 names, on a real NVIDIA GPU: the NVML adapter against the driver,
L1 swap between two GPUs, L2's move to the CPU and back, the emergency snapshot and the bitwise
resume on CUDA, ABFT under bf16 and TF32, eBPF launch counts against torch.profiler.

Every test here is marked `gpu`: without a GPU (torch.cuda and NVML both needed) conftest
skips it with the reason, in CI as well, which never has one. `make gpu-check` runs them on a
GPU machine. They go through the public API only (mscale.attach, the guard, its fuse and
snapshot engine, the injector of mscale.sim), so they hold whatever the adapters' internals.
"""

from __future__ import annotations

import os
import shutil
import subprocess

# Deterministic cuBLAS for the bitwise resume: read when cuBLAS starts, so set before any
# test here touches CUDA (collection imports this module first). Harmless without a GPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

import mscale  # noqa: E402
from mscale.findings import Reason  # noqa: E402
from mscale.sim.inject import inject, inject_mpus  # noqa: E402
from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal  # noqa: E402

pytestmark = pytest.mark.gpu

CFG = TinyConfig()
BATCH = 8
FAIL = (Reason.CHECKSUM_FAILURE, Reason.NONFINITE_OUTPUT)


class Findings:
    """A guard plugin that keeps every finding."""

    def __init__(self) -> None:
        self.items: list = []

    def on_finding(self, f) -> None:
        self.items.append(f)

    def of(self, *reasons: Reason, mpu: str | None = None) -> list:
        return [f for f in self.items if f.reason in reasons and (mpu is None or f.labels.get("mpu") == mpu)]

    def actions(self, action: str) -> list:
        return [
            f
            for f in self.items
            if f.reason == Reason.HEAL_ACTION
            and f.labels.get("action") == action
            and f.labels.get("result") == "applied"
        ]


class Job:
    """The tiny multimodal model on `device`, guarded, trained on deterministic batches."""

    def __init__(self, device: str, *, seed: int = 0, autocast: bool = False, **attach_kw) -> None:
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.model = TinyMultimodal(CFG).to(self.device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)  # foreach: steps cuda and cpu params
        self.rec = Findings()
        # every layer every step, judged after each forward: these tests are about the swap and
        # degrade paths a one-step fault starts (the commit-point verdicts: their own test)
        attach_kw.setdefault("checksum", mscale.ChecksumConfig(replay_every=0, full=True, verdicts="in_step"))
        self.guard = mscale.attach(
            self.model, self.opt, job_id="gpu-test", connect=False, plugins=[self.rec], cmsa=False, **attach_kw
        )
        self.data = SyntheticCaptions(CFG, size=100_000, seed=0)  # the same batches whatever the weights
        self.autocast = autocast
        self.i = 0
        self.losses: list[float] = []

    def train(self, n: int) -> None:
        for _ in range(n):
            b = torch.utils.data.default_collate([self.data[self.i * BATCH + j] for j in range(BATCH)])
            self.i += 1
            images, tokens = b["images"].to(self.device), b["tokens"].to(self.device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
                loss = self.model(images, tokens)["loss"]
            loss.float().backward()
            self.opt.step()
            self.opt.zero_grad()
            self.losses.append(float(loss))

    def close(self) -> None:
        self.guard.detach()


def devices_of(module: torch.nn.Module) -> set[torch.device]:
    return {p.device for p in module.parameters()}


def optimizer_state_follows(job: Job, module: torch.nn.Module) -> bool:
    """Every tensor of the optimizer's state of `module`'s parameters is on the parameter's device."""
    return all(
        v.device == p.device
        for p in module.parameters()
        for v in job.opt.state.get(p, {}).values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


# --- NVML --------------------------------------------------------------------------------------

SMI_FIELDS = "index,uuid,name,memory.total,power.limit,temperature.gpu"


def test_real_nvml_adapter_matches_nvidia_smi() -> None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("nvidia-smi not found: nothing to compare the NVML adapter against")
    from mscale.probes.nvml_api import open_real_nvml

    out = subprocess.run(
        [smi, f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    rows = [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]
    nvml = open_real_nvml()
    try:
        assert nvml.device_count() == len(rows)
        for index, uuid, name, mem_mib, power_w, temp_c in rows:
            g = int(index)
            assert nvml.uuid(g) == uuid
            assert nvml.name(g) == name
            assert nvml.memory_info(g)[1] // (1 << 20) == int(mem_mib)
            if power_w not in ("[N/A]", "[Not Supported]"):
                assert abs(nvml.power_limit_mw(g) / 1000 - float(power_w)) <= 1.0
            assert abs(nvml.temperature_c(g) - int(temp_c)) <= 5  # read a moment apart
    finally:
        nvml.close()


# --- L1 swap, L2 move to the CPU ----------------------------------------------------------------


def test_l1_swap_moves_an_mpu_to_the_second_gpu_and_the_step_completes() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip(f"L1 swap between GPUs needs 2, this machine has {torch.cuda.device_count()}")
    ref = Job("cuda:0", snapshots=True)
    ref.train(20)
    ref.close()

    job = Job("cuda:0", snapshots=True)
    vision = job.guard.mpu("vision")
    uuid_before = vision.gpu_uuid
    job.train(5)
    # corruption on GPU 0 reaching the vision MPU only, while it is bound there
    inject_mpus([vision], lambda: job.guard.current_step, kind="noise", noise_scale=0.1, gpu=0, steps=10)
    job.train(15)
    swaps = job.rec.actions("l1_swap")
    assert swaps, "no L1 swap after 3 failing steps"
    assert vision.gpu != 0 and devices_of(vision.module) == {torch.device("cuda", vision.gpu)}
    assert vision.gpu_uuid and vision.gpu_uuid != uuid_before  # the new GPU's UUID, not blank
    assert optimizer_state_follows(job, vision.module)
    assert job.rec.actions("l2_degrade") == []  # the standby is clean
    # no step lost, every loss finite, and training ends where the fault-free run does
    assert job.guard.current_step == ref.guard.current_step
    assert all(torch.isfinite(torch.tensor(job.losses)))
    tail, ref_tail = sum(job.losses[-5:]) / 5, sum(ref.losses[-5:]) / 5
    assert abs(tail - ref_tail) <= 0.05 * ref_tail
    job.close()


def test_l2_moves_an_mpu_to_the_cpu_and_recovery_brings_it_back() -> None:
    job = Job("cuda:0", snapshots=True)
    vision = job.guard.mpu("vision")
    home = devices_of(vision.module)
    job.train(3)
    # corruption that follows the MPU: 3 failing steps per GPU it can be swapped to, then L2
    tries = 3 * min(2, torch.cuda.device_count())
    inject(job.guard, kind="noise", noise_scale=0.1, mpu="vision", steps=tries)
    job.train(tries)
    assert job.rec.actions("l2_degrade"), "no L2 after the corruption followed the MPU"
    assert devices_of(vision.module) == {torch.device("cpu")}
    assert optimizer_state_follows(job, vision.module)
    job.train(2)  # degraded steps complete: inputs to the CPU, outputs back to the GPU
    assert job.rec.actions("l3_distill") == []
    job.train(60)  # a clean stretch: recovery undoes L2
    assert job.rec.actions("recover")
    assert {d.type for d in devices_of(vision.module)} == {"cuda"} and devices_of(vision.module) <= home | {
        torch.device("cuda", vision.gpu)
    }
    assert optimizer_state_follows(job, vision.module)
    assert all(torch.isfinite(torch.tensor(job.losses)))
    job.close()


# --- snapshots ---------------------------------------------------------------------------------


def test_emergency_snapshot_writes_the_newest_snapshot_whose_host_copy_completed(tmp_path) -> None:
    from mscale.snapshot.format import list_snapshots

    job = Job("cuda:0", snapshots=mscale.SnapshotConfig(directory=tmp_path, memory_every=1, disk_every=0))
    job.train(5)
    engine = job.guard.snapshots
    torch.cuda.synchronize()
    done = engine.latest()
    assert done is not None and done.is_ready()
    # hold the stream, so the next snapshot's device-to-host copy stays in flight (as on a
    # GPU that stopped answering); the emergency write must take the completed one
    torch.cuda._sleep(int(5e9))
    pending = engine.snapshot(step=done.step + 1)
    assert not pending.is_ready(), "the copy finished before the emergency write: the stream was not held"
    path = engine.emergency("gpu test").result(timeout=60)
    assert [i.step for i in list_snapshots(tmp_path)] == [done.step]
    assert path.exists()
    torch.cuda.synchronize()
    job.close()


def test_snapshot_resume_on_cuda_is_bitwise(tmp_path) -> None:
    torch.use_deterministic_algorithms(True)
    try:

        def run(directory, steps: int, *, seed: int = 0) -> Job:
            job = Job(
                "cuda:0", seed=seed, snapshots=mscale.SnapshotConfig(directory=directory, memory_every=5, disk_every=5)
            )
            start = job.guard.current_step  # after a resume: the step after the snapshot's
            job.i = start  # the batch order is the step's
            job.train(steps - start)
            return job

        whole = run(tmp_path / "whole", 20)
        whole.close()
        first = run(tmp_path / "cut", 10)
        first.close()  # disk writes finished
        resumed = run(tmp_path / "cut", 20, seed=1)  # other initial weights: all must come from the snapshot
        assert resumed.guard.current_step == whole.guard.current_step
        for (name, a), (_, b) in zip(whole.model.state_dict().items(), resumed.model.state_dict().items(), strict=True):
            assert a.device.type == "cuda" and torch.equal(a, b), name
        resumed.close()
    finally:
        torch.use_deterministic_algorithms(False)


# --- ABFT ------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
@pytest.mark.parametrize("kind", ["exponent_flip", "mantissa_flip"])
def test_abft_catches_injected_corruption_on_cuda(precision: str, kind: str) -> None:
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "tf32"
    try:
        job = Job("cuda:0", autocast=precision == "bf16")
        job.train(5)
        assert job.rec.of(*FAIL) == [], "clean steps fail their checksums: the tolerance is too tight"
        # the top mantissa bit of the largest element: the smallest flip that matters
        inj = inject(job.guard, kind=kind, mpu="vision", steps=1, seed=3, element="max")
        job.train(1)
        assert len(inj.hits) == 1
        assert [f for f in job.rec.of(*FAIL, mpu="vision") if f.labels.get("method") in ("abft", "nonfinite")]
        job.close()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


# --- eBPF ------------------------------------------------------------------------------------


def test_ebpf_launch_counts_match_torch_profiler_kernels() -> None:
    from torch.profiler import ProfilerActivity, profile

    try:
        from mscale.probes.ebpf_loader import CudaBpf, preflight
        from mscale.probes.ebpf_procfs import find_libcuda, find_libcudart

        preflight()
        bpf = CudaBpf(max_pids=4, max_threads=1024)
    except Exception as e:  # BCC, root or kernel headers missing: not a GPU path's fault
        pytest.skip(f"eBPF unavailable: {e}")
    job = Job("cuda:0")
    try:
        job.train(2)  # CUDA and its libraries loaded, caches warm
        torch.cuda.synchronize()
        pid = os.getpid()
        lib = find_libcuda(pid)
        assert lib is not None, "libcuda not mapped by a process that ran CUDA kernels"
        bpf.add_pid(pid)
        # both layers, as the probe attaches them: a runtime launch counts once
        links = bpf.attach_launches(pid, lib, find_libcudart(pid))
        before = bpf.read_stats()[pid].launches
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            job.train(50)
            torch.cuda.synchronize()
        seen = bpf.read_stats()[pid].launches - before
        for link in links:
            bpf.detach(link)
    finally:
        bpf.close()
        job.close()
    kernels = sum(
        1
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
    )
    assert kernels > 0
    assert seen > 0, "no launch seen at libcuda's exported entry points or libcudart's"
    assert abs(seen - kernels) <= max(5, kernels // 50), f"eBPF saw {seen} launches, the profiler {kernels} kernels"


def test_a_guarded_step_reads_nothing_back_before_the_commit_point() -> None:
    """The default on a GPU: verdicts read once, at the optimizer step. Forward and backward
    of clean steps run under torch.cuda.set_sync_debug_mode("error"), so any host read-back in
    them (an .item(), a .tolist(), a D2H copy) raises; every MPU is replayed every step too (the replay's
    comparison stays on the device). A fault is still caught, at the commit point, and its
    update dropped. The budget's CUDA events measured the checks' cost."""
    job = Job("cuda", checksum=mscale.ChecksumConfig(replay_every=1))
    det = job.guard.checksum
    try:
        for i in range(4):
            if i == 3:
                inject(job.guard, kind="exponent_flip", mpu="vision", steps=1, seed=2)
            b = torch.utils.data.default_collate([job.data[i * BATCH + j] for j in range(BATCH)])
            images, tokens = b["images"].cuda(), b["tokens"].cuda()
            reads = det.readbacks
            # (the injector itself reads the value it corrupts: its step runs without the mode)
            torch.cuda.set_sync_debug_mode("error" if i < 3 else "default")
            try:
                loss = job.model(images, tokens)["loss"]
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert det.readbacks == reads
            job.opt.step()
            job.opt.zero_grad()
            assert det.readbacks == reads + 1
        assert job.rec.of(*FAIL, mpu="vision")
        assert job.guard.summary()["guard_overhead_ratio"] > 0  # CUDA events resolved, no sync
    finally:
        job.close()
