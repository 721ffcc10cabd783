"""Ranks of one training job as real processes (no tests in this file).

    python tests/support/rank_job.py --socket S --job J --ranks 8 --steps 6 --stop FILE --out DIR

imports torch and the hook library once, then forks one child per rank (RANK, LOCAL_RANK and
WORLD_SIZE in its environment, as a launcher sets them; no process group). Rank i trains the
tiny model attached to the agent at S for `steps + i` steps (so the ranks stand at different
steps), writes "rank last_step loss" to DIR/rank_i (atomically: a file there is whole; the
ranks' logs share stdout) and stays connected until FILE exists (deadline
600 s), then detaches and exits. The parent exits with the first failing child's status.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from forked import fork_ranks  # tests/support/, the script's own folder

from mscale.hook import attach
from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal

DEADLINE_S = 600.0  # the test touches the stop file when done; this only bounds a lost test


def rank_main(args: argparse.Namespace, rank: int) -> int:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.ranks))
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    cfg = TinyConfig()
    model = TinyMultimodal(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = attach(
        model, opt, job_id=args.job, socket_path=args.socket, gpus={"vision": rank, "aligner": rank, "text": rank}
    )
    data = iter(torch.utils.data.DataLoader(SyntheticCaptions(cfg, size=256, seed=rank), batch_size=4))
    loss = float("nan")
    for _ in range(args.steps + rank):
        b = next(data)
        out = model(b["images"], b["tokens"])["loss"]
        out.backward()
        opt.step()
        opt.zero_grad()
        loss = float(out)
    tmp = Path(args.out, f".rank_{rank}")
    tmp.write_text(f"{rank} {guard.current_step - 1} {loss!r}")
    tmp.rename(Path(args.out, f"rank_{rank}"))
    deadline = time.monotonic() + DEADLINE_S
    while not os.path.exists(args.stop) and time.monotonic() < deadline:
        time.sleep(0.05)
    guard.detach()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--stop", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    return fork_ranks(args.ranks, lambda rank: rank_main(args, rank))


if __name__ == "__main__":
    raise SystemExit(main())
