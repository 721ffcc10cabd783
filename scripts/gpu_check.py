"""The one device check (issue 13): run on a machine with an NVIDIA GPU, in under 8 minutes.

    make gpu-check                     # or: .venv/bin/python scripts/gpu_check.py --out gpu-check

It runs every `gpu`-marked test (tests/test_gpu_paths.py) and measures, on the tiny
multimodal model:

- NVML through the real adapter against `nvidia-smi --query-gpu` for the same fields, and what
  one sample of every GPU costs (with the PCIe throughput calls, about 20 ms each, on their own);
- eBPF launch counts against torch.profiler's kernel count over 50 training steps (root and BCC),
  at the driver's exported entry points alone and at driver and runtime (libcudart) together;
- the snapshot stall (one in-memory snapshot) against torch.save of the same state, a ratio;
- the guard's overhead against the loop with clip_grad_norm_ at benchmarks/hook_overhead.py's
  realistic shape (arms interleaved), each MPU's coverage and largest gap between checks, the
  guard's own measure (CUDA events), and incident mode's cost for reference, fp32 and bf16;
- L2: the vision MPU moved to the CPU by the fuse and back by recovery, the steps' times.

Each part runs in a process of its own under a deadline (PART_TIMEOUT_S, and what is left of
TOTAL_BUDGET_S), so a hung CUDA call costs that part, not the run. It writes report.md and
report.json under --out. Without a GPU it says so, lists what it would check, and exits 0.
Exit status 1 when a test failed or a measurement raised or ran out of time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CHECKS = (
    "every gpu-marked test (tests/test_gpu_paths.py)",
    "NVML (real adapter) against nvidia-smi --query-gpu; the cost of one GPU sample and of its PCIe throughput calls",
    "eBPF launch counts against torch.profiler's kernel count over 50 steps (driver alone; driver and runtime)",
    "snapshot stall against torch.save (ratio)",
    "guard overhead against clip_grad_norm_ at the realistic shape, coverage, max gap, incident mode's cost (fp32, bf16)",
    "L2: an MPU moved to the CPU and back, step times",
)
TOTAL_BUDGET_S = 450  # the whole check, under the 8 minutes
TEST_BUDGET_S = 210  # the gpu-marked tests
PART_TIMEOUT_S = {  # each measurement, in its own process
    "nvml_vs_nvidia_smi": 30,
    "ebpf_vs_profiler": 60,
    "snapshot_stall": 40,
    "guard_overhead": 60,
    "l2_round_trip": 40,
}
SMI_FIELDS = ("uuid", "name", "memory.total", "memory.used", "power.limit", "temperature.gpu", "clocks.sm")


def no_gpu_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False" + (
            f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})"
            if "CUDA_VISIBLE_DEVICES" in os.environ
            else ""
        )
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception as e:
        return f"NVML unavailable ({e})"
    return None if n else "NVML lists no device"


# --- the tests -------------------------------------------------------------------------------


def run_tests(out: Path) -> dict:
    xml = out / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu_paths.py"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [*cmd, f"--junitxml={xml}"], cwd=REPO, capture_output=True, text=True, timeout=TEST_BUDGET_S
        )
        tail, rc = (proc.stdout + proc.stderr)[-6000:], proc.returncode
    except subprocess.TimeoutExpired as e:
        tail, rc = f"timed out after {TEST_BUDGET_S} s\n{e.stdout or ''}", -1
    (out / "gpu-tests.log").write_text(tail)
    cases = []
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    outcome += ": " + (el.get("message") or "")[:300]
            cases.append({"test": case.get("name"), "outcome": outcome})
    return {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "cases": cases}


# --- measurements ---------------------------------------------------------------------------


def tiny_job(device: str, *, guarded: bool, autocast: bool = False, snapshots: Any = None, seed: int = 0):
    import torch

    import mscale
    from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal

    cfg = TinyConfig()
    torch.manual_seed(seed)
    model = TinyMultimodal(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = mscale.attach(model, opt, job_id="gpu-check", connect=False, snapshots=snapshots) if guarded else None
    data = SyntheticCaptions(cfg, size=100_000, seed=seed)
    state = {"i": 0}

    def step() -> float:
        b = torch.utils.data.default_collate([data[state["i"] * 8 + j] for j in range(8)])
        state["i"] += 1
        images, tokens = b["images"].to(device), b["tokens"].to(device)
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(images, tokens)["loss"]
        loss.float().backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    return model, opt, guard, step


def nvml_vs_smi() -> dict:
    from mscale.probes.nvml_api import open_real_nvml

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"skipped": "nvidia-smi not found"}
    text = subprocess.run(
        [smi, "--query-gpu=index," + ",".join(SMI_FIELDS), "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    nvml = open_real_nvml()
    rows = []
    try:
        for line in text.strip().splitlines():
            idx, uuid, name, mem_total, mem_used, power_limit, temp, sm = (c.strip() for c in line.split(","))
            g = int(idx)
            used, total = nvml.memory_info(g)
            rows.append(
                {
                    "gpu": g,
                    "uuid": [nvml.uuid(g), uuid],
                    "name": [nvml.name(g), name],
                    "memory_total_mib": [total // (1 << 20), mem_total],
                    "memory_used_mib": [used // (1 << 20), mem_used],
                    "power_limit_w": [nvml.power_limit_mw(g) / 1000, power_limit],
                    "temperature_c": [nvml.temperature_c(g), temp],
                    "sm_clock_mhz": [nvml.clocks_mhz(g)[0], sm],
                }
            )
        # what one GPU sample costs: NVML samples PCIe throughput over about 20 ms per call,
        # and the probe makes two per GPU
        from mscale.probes.gpu import NvmlReader

        reader = NvmlReader(nvml)
        t0 = time.perf_counter()
        reader.read()
        read_ms = (time.perf_counter() - t0) * 1e3
        pcie_ms = []
        for g in range(nvml.device_count()):
            t0 = time.perf_counter()
            nvml.pcie_throughput_kbs(g)
            pcie_ms.append((time.perf_counter() - t0) * 1e3)
    finally:
        nvml.close()
    cost = {"read_all_gpus_ms": read_ms, "pcie_throughput_ms_per_gpu": pcie_ms}
    return {"fields": "[NVML adapter, nvidia-smi]", "gpus": rows, "sample_cost": cost}


def ebpf_vs_profiler() -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        from mscale.probes.ebpf import find_libcuda, find_libcudart
        from mscale.probes.ebpf_loader import CudaBpf, preflight

        preflight()
        bpf = CudaBpf(max_pids=4, max_threads=1024)
    except Exception as e:
        return {"skipped": f"eBPF unavailable: {e}"}
    _, _, guard, step = tiny_job("cuda:0", guarded=True)
    out: dict[str, Any] = {}
    try:
        step()
        pid = os.getpid()
        lib, rt = find_libcuda(pid), find_libcudart(pid)
        out.update(libcuda=lib, libcudart=rt)
        if lib is None:
            return {"error": "libcuda not found in this process's maps"}
        bpf.add_pid(pid)
        # 50 steps per layer set: the driver's exported entry points alone (do PyTorch's
        # launches reach them, or go through cuGetProcAddress?), then both layers, deduped
        for name, runtime in (("driver_only", None), ("driver_and_runtime", rt)):
            links = bpf.attach_launches(pid, lib, runtime)
            before = bpf.read_stats()[pid].launches
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(50):
                    step()
            seen = bpf.read_stats()[pid].launches - before
            for link in links:
                bpf.detach(link)
            kernels = sum(
                1
                for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))
            )
            out[name] = {
                "ebpf_launches": seen,
                "profiler_kernels": kernels,
                "ratio": seen / kernels if kernels else None,
            }
    finally:
        bpf.close()
        guard.detach()
    return out


def snapshot_stall() -> dict:
    import torch

    from mscale.snapshot.engine import SnapshotEngine

    model, opt, guard, step = tiny_job("cuda:0", guarded=False)
    for _ in range(3):
        step()
    engine = SnapshotEngine(model, opt, mpus={})
    stalls, saves = [], []
    with tempfile.TemporaryDirectory() as d:
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.snapshot()  # what the training thread waits for; the copy lands in the background
            stalls.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, Path(d) / "state.pt")
            saves.append(time.perf_counter() - t0)
    engine.close()
    stall, save = min(stalls), min(saves)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"param_bytes": nbytes, "stall_s": stall, "torch_save_s": save, "save_over_stall": save / stall}


def guard_overhead(steps: int = 30) -> dict:
    """The guard's cost on the GPU at benchmarks/hook_overhead.py's realistic shape (hidden 512,
    FFN 4x, 2+2 layers, 144 patches + 64 tokens, batch 8), fp32 and bf16: three arms interleaved
    step by step, each step timed to a CUDA sync: the loop with clip_grad_norm_, the default
    guard (`ChecksumConfig()`: the budget of 1%), and incident mode for reference (every layer
    checked, every MPU replayed, every step). With each MPU's coverage and largest gap between
    checks, and what the guard measured of itself (CUDA events for the checks)."""
    import torch

    import mscale
    from mscale.hook.checks.checksum import ChecksumConfig
    from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal

    cfg = TinyConfig(
        patch=4, vision_hidden=512, text_hidden=512, heads=8, vision_layers=2, text_layers=2, vocab=1024,
        image_size=48, ffn_mult=4, seq_len=64,
    )  # fmt: skip
    data = SyntheticCaptions(cfg, size=100_000, seed=0)
    out: dict[str, Any] = {"shape": "hook_overhead.py realistic: hidden 512, FFN 4x, 2+2 layers, batch 8"}
    for precision, autocast in (("fp32", False), ("bf16", True)):
        arms: dict[str, tuple] = {}
        for arm, ccfg in (("clip", None), ("guarded", ChecksumConfig()), ("incident", None)):
            torch.manual_seed(0)
            model = TinyMultimodal(cfg).to("cuda:0")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            full = ChecksumConfig(full=True, replay_every=1)
            guard = None
            if arm != "clip":
                guard = mscale.attach(model, opt, job_id=f"gpu-{arm}", connect=False, checksum=ccfg or full)
            arms[arm] = (model, opt, guard, [])
        try:
            names = list(arms)
            for i in range(5 + steps):
                b = torch.utils.data.default_collate([data[i * 8 + j] for j in range(8)])
                images, tokens = b["images"].to("cuda:0"), b["tokens"].to("cuda:0")
                for k in range(len(names)):  # the order rotating: every arm in every place
                    arm = names[(i + k) % len(names)]
                    model, opt, guard, times = arms[arm]
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                        loss = model(images, tokens)["loss"]
                    loss.float().backward()
                    if guard is None:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
                    opt.step()
                    opt.zero_grad()
                    torch.cuda.synchronize()
                    if i >= 5:
                        times.append(time.perf_counter() - t0)
            med = {arm: statistics.median(a[3]) for arm, a in arms.items()}
            g = arms["guarded"][2]
            out[precision] = {
                "step_ms": {arm: v * 1e3 for arm, v in med.items()},
                "guard_overhead": med["guarded"] / med["clip"] - 1,
                "incident_overhead": med["incident"] / med["clip"] - 1,
                "coverage": {
                    f"{m.mpu_id} {m.name}": {
                        "coverage_ratio": g.checksum.figures()[m.mpu_id]["coverage_ratio"],
                        "max_gap_steps": g.checksum.figures()[m.mpu_id]["max_gap_steps"],
                    }
                    for m in g.mpus
                },
                "guard_measured": g.budget.figures(),
            }
        finally:
            for _, _, guard, _ in arms.values():
                if guard is not None:
                    guard.detach()
    return out


def l2_round_trip() -> dict:
    import torch

    from mscale.sim.inject import inject

    _, _, guard, step = tiny_job("cuda:0", guarded=True, snapshots=True)
    vision = guard.mpu("vision")
    log: list[tuple[int, str, float]] = []
    try:
        for _ in range(3):
            step()
        tries = 3 * min(2, torch.cuda.device_count())
        inject(guard, kind="noise", noise_scale=0.1, mpu="vision", steps=tries)
        for _ in range(tries + 70):
            s = guard.current_step
            t = step()
            log.append((s, str(vision.device), t))
    finally:
        guard.detach()
    devices = [d for _, d, _ in log]
    to_cpu = next((i for i, d in enumerate(devices) if d == "cpu"), None)
    back = None
    if to_cpu is not None:
        back = next((i for i in range(to_cpu, len(devices)) if devices[i] != "cpu"), None)
    times = [t for _, _, t in log]
    return {
        "moved_to_cpu_at_step": log[to_cpu][0] if to_cpu is not None else None,
        "back_at_step": log[back][0] if back is not None else None,
        "device_after": devices[-1],
        "step_ms_median": statistics.median(times) * 1e3,
        "step_ms_move_to_cpu": times[to_cpu] * 1e3 if to_cpu is not None else None,
        "step_ms_degraded_median": statistics.median(times[to_cpu:back]) * 1e3 if to_cpu is not None and back else None,
        "step_ms_move_back": times[back] * 1e3 if back is not None else None,
    }


MEASUREMENTS: dict[str, Callable[[], dict]] = {
    "nvml_vs_nvidia_smi": nvml_vs_smi,
    "ebpf_vs_profiler": ebpf_vs_profiler,
    "snapshot_stall": snapshot_stall,
    "guard_overhead": guard_overhead,
    "l2_round_trip": l2_round_trip,
}


def report_md(report: dict) -> str:
    lines = [f"# gpu-check, {report['when']}", "", f"Device: {report['device']}", "", "## gpu-marked tests", ""]
    t = report["tests"]
    lines.append(f"pytest exit status {t['rc']}, {t['seconds']} s")
    lines += ["", "| test | outcome |", "|---|---|"]
    lines += [f"| {c['test']} | {c['outcome']} |" for c in t["cases"]]
    lines += ["", "## Measurements", ""]
    for name, value in report["measurements"].items():
        lines += [f"### {name}", "", "```json", json.dumps(value, indent=2, default=str), "```", ""]
    return "\n".join(lines)


def run_part(argv: list[str], timeout_s: float) -> dict:
    """One part in a process of its own: its last stdout line is its JSON result. A part that
    runs past timeout_s is killed and reported as such; the check goes on with the next."""
    try:
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=max(1.0, timeout_s))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {max(1.0, timeout_s):.0f} s"}
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    if proc.returncode != 0 or not isinstance(result, dict):
        return {"error": f"exit status {proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}"}
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-check", help="where report.md and report.json go (default gpu-check/)")
    ap.add_argument("--skip-tests", action="store_true", help="measurements only")
    ap.add_argument("--part", choices=sorted(MEASUREMENTS), help="run one measurement here, print its JSON")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.part:  # the child process of run_part
        try:
            result = MEASUREMENTS[args.part]()
        except Exception:
            result = {"error": traceback.format_exc()[-2000:]}
        print(json.dumps(result, default=str))
        return 0
    reason = no_gpu_reason()
    if reason is not None:
        print(f"gpu-check: no GPU here: {reason}. Nothing run, nothing written.")
        print("On a machine with an NVIDIA GPU it checks, in under 8 minutes:")
        for c in CHECKS:
            print(f"  - {c}")
        print(f"and writes report.md and report.json under {args.out}/.")
        return 0
    import torch

    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}",
        "tests": {"rc": 0, "seconds": 0, "cases": []} if args.skip_tests else run_tests(out),
        "measurements": {},
    }
    failed = report["tests"]["rc"] != 0
    for name in MEASUREMENTS:
        print(f"== {name}", flush=True)
        left = TOTAL_BUDGET_S - (time.monotonic() - started)
        result = run_part([sys.executable, __file__, "--part", name], min(PART_TIMEOUT_S[name], left))
        report["measurements"][name] = result
        failed = failed or "error" in result
        print(json.dumps(result, default=str), flush=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (out / "report.md").write_text(report_md(report))
    print(f"gpu-check: report in {out}/report.md and {out}/report.json; {'FAILED' if failed else 'all passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
