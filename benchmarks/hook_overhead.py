"""Step time with the hook library attached against the same loop without it, on CPU.

Two identical TinyMultimodal models of realistic width (hidden 512), trained on the same
batches, steps interleaved (plain, guarded, plain, guarded, ...) so both see the same
machine load. The guarded one has ABFT on every linear every step, replay 1 step in 100,
CMSA, the loss/grad statistics and reports to a running agent (`mscale agent` started here
as a subprocess on a temporary Unix socket, probes that need hardware off). Prints the median
step times, the ratio, and the guard's own time per step by part.

    .venv/bin/python benchmarks/hook_overhead.py [--steps 200] [--hidden 512] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mscale.hook.guard import attach  # noqa: E402
from mscale.probes.checksum import ChecksumConfig  # noqa: E402
from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal  # noqa: E402


def start_agent(tmp: str) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(tmp, "agent.sock")
    cfg = os.path.join(tmp, "agent.toml")
    Path(cfg).write_text(f'[agent]\nlisten = "127.0.0.1:0"\nsocket_path = "{sock}"\nlog_level = "warning"\n'
                         "[probes.gpu]\nenabled = false\n[probes.ebpf]\nenabled = false\n")
    proc = subprocess.Popen([sys.executable, "-m", "mscale", "agent", "--config", cfg], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not os.path.exists(sock):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"agent did not start (exit {proc.poll()})")
        time.sleep(0.05)
    return proc, sock


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="timed steps per loop")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared machine)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import structlog, logging  # noqa: E401
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))

    cfg = TinyConfig(image_size=32, patch=4, vision_hidden=args.hidden, text_hidden=args.hidden, heads=8,
                     vision_layers=args.layers, text_layers=args.layers, vocab=1024, seq_len=32)
    data = SyntheticCaptions(cfg, size=100_000)
    n = args.warmup + args.steps
    batches = [torch.utils.data.default_collate([data[i * args.batch + j] for j in range(args.batch)]) for i in range(n)]

    def model_and_opt():
        torch.manual_seed(0)
        model = TinyMultimodal(cfg)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    plain, plain_opt = model_and_opt()
    guarded, guarded_opt = model_and_opt()
    tmp = tempfile.mkdtemp(prefix="mscale-bench-")
    agent, sock = start_agent(tmp)
    try:
        guard = attach(guarded, guarded_opt, job_id="bench", socket_path=sock,
                       checksum=ChecksumConfig(replay_every=100))
        deadline = time.monotonic() + 30
        while not guard.link.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert guard.link.connected, "the hook did not connect to the agent"
        params = sum(p.numel() for p in plain.parameters())
        print(f"model: hidden {args.hidden}, {args.layers}+{args.layers} layers, {params / 1e6:.1f}M params, "
              f"batch {args.batch}, {cfg.patches} patches + {cfg.seq_len} tokens, torch threads {args.threads}")

        def step(model, opt, b) -> float:
            t = time.perf_counter()
            model(b["images"], b["tokens"])["loss"].backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return time.perf_counter() - t

        base, with_guard, parts = [], [], {}
        for i, b in enumerate(batches):
            tb = step(plain, plain_opt, b)
            tg = step(guarded, guarded_opt, b)
            if i < args.warmup:
                continue
            base.append(tb)
            with_guard.append(tg)
            for k, v in vars(guard.times).items():
                parts.setdefault(k, []).append(v)
        mb, mg = statistics.median(base), statistics.median(with_guard)
        sb, sg = sum(base), sum(with_guard)
        print(f"step time, median: plain {mb * 1e3:.2f} ms, guarded {mg * 1e3:.2f} ms, "
              f"ratio {mg / mb:.4f} ({(mg / mb - 1) * 100:+.2f}% added; target < 3%)")
        print(f"step time, mean:   plain {sb / len(base) * 1e3:.2f} ms, guarded {sg / len(base) * 1e3:.2f} ms, "
              f"ratio {sg / sb:.4f} (includes the {args.steps // 100} replay step(s))")
        print("guard's own time per step, mean, by part (share of the plain step):")
        for k, v in parts.items():
            mean = sum(v) / len(v)
            print(f"  {k.removesuffix('_s'):12s} {mean * 1e3:8.3f} ms  {mean / (sb / len(base)) * 100:6.2f}%")
        print(f"reports: sent {guard.link.sent}, dropped {guard.link.dropped}; checksum failures "
              f"{sum(m.checksum_failures_total for m in guard.mpus)}")
        guard.detach()
    finally:
        agent.terminate()
        agent.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
