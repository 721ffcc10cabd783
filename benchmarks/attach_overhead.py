"""What the README's whole line costs a Hugging Face model's step, on CPU:
`mscale.attach(model, opt, job_id=..., snapshots=True, data=loader)` (the guard, the fuse, the
in-memory snapshots and their rollback) against the plain loop with `clip_grad_norm_`.

The model is a LLaVA built from its config (random weights, nothing downloaded): a CLIP vision
tower and a Llama text model of hidden 256 and 4 layers each, FFN 1024, 8x8 patches,
vocabulary 1024, batch 8: 8.1M parameters, the model on which the line was first measured at
+9% to +20% of a 490 ms step. `--shape` sets the tokens a sample: `realistic` (the default)
96x96 images (144 image tokens) and 64 caption tokens, as many tokens a sample as
benchmarks/hook_overhead.py's realistic shape; `issue` 64x64 images (64 image tokens) and 32
caption tokens, the shape of that first measurement.

Arms, one model, optimizer (AdamW) and `mscale.ResumableLoader` each, all drawing the same
batches, one step of each per batch, the order shifted by one arm each batch (every arm in
every place equally often), one torch thread:

- clip: the plain loop with `clip_grad_norm_(max_norm=1.0)` (CMSA replaces that clip).
- control: a second clip arm; control / clip is truly 1.00, how far it strays is the noise a
  verdict must exceed (benchmarks/_verdict.py).
- attached: the README's line as shipped (the link to an agent off: `connect=False`; what the
  link costs is benchmarks/hook_overhead.py's).
- guard-only: `mscale.attach(model, opt, job_id=...)` without snapshots (the guard's own
  checks, statistics and the gradient check; no fuse): attached minus guard-only is what the
  fuse and the snapshots add (--no-guard-only drops it).
- incident (reference, on by default; --no-incident drops it): the README's line with every
  layer checked and every MPU replayed every step (`ChecksumConfig(full=True, replay_every=1)`):
  what an MPU under suspicion costs (incident mode), the cost of full coverage.
- every-weight (reference, --full): the README's line with
  `healing=HealingSection(weight_groups=1)`, every trained weight fingerprinted in every window
  between steps (the shipped default rotates over 8 groups).

Repeats. The run is --repeats repeats; each builds every arm afresh (in an order rotated by one
arm each repeat), runs --warmup untimed steps of each, then its share of --steps timed steps of
each, interleaved. A repeat's figure is taken round by round: the median over its rounds of the
arm's step over clip's step of the same round (benchmarks/_verdict.paired); the
verdict (at most +1%) is on the median of the repeats, "inconclusive" when the control strays
from 1.00 by more than the overhead from the target. Wall time and the training thread's CPU
time (time.thread_time over the step; with one torch thread a CPU step's kernels all run on it;
the snapshot copier's thread is timed on its own, see Rare work) are both measured; CPU time is the sound figure
under load: another process on the core stretches wall time, not the work the step does. Run
twice: with the machine otherwise idle, and with a second process spinning on one core
(started and stopped here, by its pid; where the system can pin, the spinner on one core and
this process on the other for the whole load, so that the busy core stays the same one and the
training thread is not moved onto a cold cache mid-step).

Why it can conclude on a shared 2-core machine: the arms are interleaved step by step with the
order rotating, so a neighbour's burst lands on every arm alike; each repeat's figure is a median
of the rounds' ratios (a slowdown longer than a round scales both steps of a round alike and
cancels in their ratio; a shorter one moves one round's ratio, which no median follows; a ratio
of two medians would move by a whole burst that covered more steps of one arm than of the
other); and CPU time leaves out the time
the process waited for a core, the noise that dominates wall time under load (what it keeps,
cache and memory contention, hits the control alike). Fresh arms each repeat: two identical
models built one after the other differ by a few percent of CPU time for as long as they live
(where their tensors landed, how they share cache sets: the control against clip showed it,
and the guard alone once measured above the whole line), a bias more steps never average out;
rebuilt each repeat, in a rotated order, it varies between repeats, where the control's spread
measures it and the median of the repeats sets it aside. The load average is printed with each
run. What the verdict calls noise is the spread of the repeats' figures (and the control's),
not the uncertainty of their median: more repeats do not shrink it, more rounds a repeat do
(each repeat's figure is a median of its rounds). With a core busy a round's ratio scatters by
about 4% on this machine, so a verdict within the target's 1% there takes tens of rounds a
repeat: `--steps 450 --repeats 5 --no-guard-only --no-incident` gives 90.

Rare work. Some of what the line does happens one step in many: a replay of an MPU's forward
(one step in 50 to 150, paid from the budget's replay bank), an in-memory snapshot every 10
steps (its capture on the training thread, its copy and then its verification on the copier's
thread: mscale/snapshot/verify.py). A median step leaves such work out, so an arm's cost per
repeat is the median of its steps with each step's rare work taken out (timed where it runs:
the replays by the guard, `checksum.replay_s`; the capture's waits by the snapshot engine,
`stall_s`; the background copy's CPU time by a timer this script wraps around it, the
verification's by the engine, `verifier.cpu_s`), plus what that work costs a step over a run:
the snapshot's timed seconds as they came, and the replays at the rate the bank pays for them,
`replay_share` x budget x step time a step at most, paid only from what the budget leaves, or
the ceiling's turns (each MPU once in `replay_max_gap_steps`) where they cost more:
`Schedule.replay_rate_s` (a repeat is shorter than the gap between two replays). The copier's
CPU counts on both clocks, as if on the training thread (conservative; verify_thread.py: the
training thread alone). Incident mode: nothing rare.

Printed besides: each MPU's coverage (share of its layers checked in the last step), the largest
gap between checks of any layer, and the guard's own measured overhead ratio and cost by part.

    PYTHONPATH=. .venv/bin/python benchmarks/attach_overhead.py [--steps 40] [--repeats 5]
        [--load idle,busy] [--full] [--no-incident] [--no-guard-only]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _verdict import Report, add_json_arg, add_warmup_arg, paired  # noqa: E402

import mscale  # noqa: E402
from mscale.healing.settings import HealingSection  # noqa: E402
from mscale.hook.checks.checksum import ChecksumConfig  # noqa: E402

IMAGE_TOKEN = 1000
PATCH, VOCAB = 8, 1024
HIDDEN, LAYERS = 256, 4  # the default LLaVA: the 8.1M one the line was first measured on
# (image side in pixels, caption tokens) per shape; the weights are the same (--hidden, --layers)
SHAPES = {
    # the shape the line was first measured on: 64 image tokens (8x8 patches of 64x64) + 32
    "issue": (64, 32),
    # as many tokens a sample as benchmarks/hook_overhead.py's realistic shape: 144 image tokens
    # (96x96) + 64, 208 a sample (LLaVA-1.5 feeds 576 image tokens and a prompt)
    "realistic": (96, 64),
}


def llava(hidden: int, layers: int, image: int = 64):
    """A LLaVA (CLIP + Llama) built from its config, random weights."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        image_size=image,
        patch_size=PATCH,
        projection_dim=hidden,
    )
    text = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=512,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    return LlavaForConditionalGeneration(cfg)


class Captions(torch.utils.data.Dataset):
    """Image tokens, then a caption; pixels and caption a function of the index."""

    def __init__(self, image: int = 64, caption: int = 32) -> None:
        self.image, self.caption = image, caption

    def __len__(self) -> int:
        return 1 << 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        ids = torch.cat(
            [
                torch.full(((self.image // PATCH) ** 2,), IMAGE_TOKEN),
                torch.randint(0, 999, (self.caption,), generator=g),
            ]
        )
        labels = ids.masked_fill(ids == IMAGE_TOKEN, -100)
        pixels = torch.rand(3, self.image, self.image, generator=g)
        return {"input_ids": ids, "pixel_values": pixels, "labels": labels}


class Arm:
    def __init__(
        self,
        name: str,
        args: argparse.Namespace,
        *,
        healing: HealingSection | None = None,
        clip: bool,
        snapshots: bool = True,
        checksum: ChecksumConfig | None = None,
    ):
        self.name, self.clip = name, clip
        image, caption = SHAPES[args.shape]
        self.model = llava(args.hidden, args.layers, image)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.loader = mscale.ResumableLoader(Captions(image, caption), batch_size=args.batch, seed=0)
        self.guard = None
        if healing is not None and snapshots:
            self.guard = mscale.attach(
                self.model,
                self.opt,
                job_id=f"bench-{name}",
                snapshots=True,
                data=self.loader,
                healing=healing,
                connect=False,
                **({"checksum": checksum} if checksum is not None else {}),
            )
        elif healing is not None:  # the watch-only guard: no fuse, no snapshots
            self.guard = mscale.attach(self.model, self.opt, job_id=f"bench-{name}", healing=healing, connect=False)
        self.batches = iter(self.loader)
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.rare: list[float] = []  # seconds of rare work timed in each timed step
        self.charged: list[float] = []  # what it costs a step over a run (see the docstring)

    def snapshot_s(self) -> float:
        """Snapshot seconds so far: the training thread's waits on captures, the CPU time of their
        copies and verifications (on the copier's thread), and the fuse's reading of the verdicts."""
        fuse = getattr(self.guard, "fuse", None)
        engine = getattr(fuse, "snapshot_engine", None)
        verify = getattr(getattr(fuse, "states", {}).get("restore_weights"), "verify_s", 0.0)  # reading the verdicts
        copies = 0.0 if engine is None else COPY_CPU.get(id(engine.copier), 0.0) + engine.verifier.cpu_s
        return 0.0 if engine is None else engine.stall_s + copies + verify

    def step(self, keep: bool) -> None:
        s0 = self.snapshot_s()
        t, c = time.perf_counter(), time.thread_time()
        batch = next(self.batches)
        self.model(**batch).loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if keep:
            self.wall.append(time.perf_counter() - t)
            self.cpu.append(time.thread_time() - c)
            snap, replay, deposit = self.snapshot_s() - s0, 0.0, 0.0
            if self.guard is not None:
                schedule = self.guard.checksum.schedule
                if schedule.replay_share > 0:  # background replays: rare work
                    replay = self.guard.checksum.replay_s  # (this step's: reset at each step's begin)
                    deposit = schedule.replay_rate_s()
            self.rare.append(snap + replay)
            self.charged.append(snap + deposit)

    def close(self) -> None:
        if self.guard is not None:
            self.guard.detach()

    def release(self) -> None:
        """Keep the step times only (a repeat's models, optimizers and snapshots freed)."""
        self.model = self.opt = self.loader = self.batches = self.guard = None  # type: ignore[assignment]


COPY_CPU: dict[int, float] = {}  # id(HostCopier) -> CPU seconds of its background copies


def time_background_copies() -> None:
    """Wrap HostCopier._copy_late, for this run, with a timer of its thread's CPU time kept per
    copier: the snapshot copy beside training is rare work off the training thread."""
    from mscale.snapshot.memory import HostCopier

    inner = HostCopier._copy_late

    def timed(self: HostCopier, pairs: Any, done: Any) -> None:
        t0 = time.thread_time()
        try:
            inner(self, pairs, done)
        finally:
            COPY_CPU[id(self)] = COPY_CPU.get(id(self), 0.0) + time.thread_time() - t0

    HostCopier._copy_late = timed  # type: ignore[method-assign]


def fmt_pct(xs: list[float]) -> str:
    return f"{statistics.median(xs):+.2%} (range {min(xs):+.2%} to {max(xs):+.2%}, n={len(xs)})"


def spinner() -> subprocess.Popen:
    """A second process keeping one core busy (stopped by the caller, by its pid)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def pin_apart(spin: subprocess.Popen) -> set[int] | None:
    """The spinner on one core, this thread (and the threads it starts later: the snapshot
    copier) on another, so the core the spinner keeps busy stays the same one all run: left to
    the scheduler, the two swap cores now and then and the training thread starts again on a
    cold cache, a noise of several percent a step that has nothing to do with the arms. Returns
    the affinity to restore, None where this system cannot pin (then nothing changed)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    before = os.sched_getaffinity(0)
    if len(before) < 2:
        return None
    ours, theirs = sorted(before)[:2]
    os.sched_setaffinity(spin.pid, {theirs})
    os.sched_setaffinity(0, {ours})
    return before


@contextlib.contextmanager
def busy_core(on: bool) -> Iterator[bool]:
    """With `on`, the block runs beside a spinner pinned apart (pin_apart), stopped by its pid
    afterwards, whatever happens, and this process's affinity restored; without, as it is.
    Yields whether the two were pinned apart."""
    if not on:
        yield False
        return
    spin = spinner()
    pinned: set[int] | None = None
    try:
        pinned = pin_apart(spin)
        yield pinned is not None
    finally:
        spin.kill()
        spin.wait(timeout=30)
        if pinned is not None:
            os.sched_setaffinity(0, pinned)


def build_arms(args: argparse.Namespace, rotate: int) -> list[Arm]:
    """The arms, built in an order rotated by `rotate` (each model's memory lands elsewhere in
    each repeat), returned in their fixed order (clip first)."""
    makers = [
        lambda: Arm("clip", args, clip=True),
        lambda: Arm("control", args, clip=True),
        lambda: Arm("attached", args, healing=HealingSection(), clip=False),
    ]
    if args.guard_only:
        makers.append(lambda: Arm("guard-only", args, healing=HealingSection(), clip=False, snapshots=False))
    if args.incident:
        full = ChecksumConfig(full=True, replay_every=1)
        makers.append(lambda: Arm("incident", args, healing=HealingSection(), clip=False, checksum=full))
    if args.full:
        makers.append(lambda: Arm("every-weight", args, healing=HealingSection(weight_groups=1), clip=False))
    n = len(makers)
    built = {k: makers[k]() for k in [(rotate + j) % n for j in range(n)]}
    return [built[k] for k in range(n)]


def run_repeat(args: argparse.Namespace, r: int, steps: int) -> list[Arm]:
    """One repeat: fresh arms, warm-up steps, then `steps` timed steps of each arm interleaved,
    the order shifted by one arm each batch. The arms are returned closed."""
    arms = build_arms(args, r)
    try:
        n = len(arms)
        orders = [[(i + j) % n for j in range(n)] for i in range(n)]  # each arm in each place in turn
        for i in range(args.warmup + steps):
            for k in orders[(i + r) % n]:
                arms[k].step(keep=i >= args.warmup)
    finally:
        for a in arms:
            a.close()
    return arms


def run_load(load: str, args: argparse.Namespace, rep: Report) -> None:
    load_before = os.getloadavg()
    busy = load == "busy"
    repeats: list[list[Arm]] = []
    with busy_core(busy) as pinned:
        per = args.steps // args.repeats
        for r in range(args.repeats):
            repeats.append(run_repeat(args, r, per))
            if r < args.repeats - 1:
                for a in repeats[-1]:
                    a.release()
            print(f"  ({load}: repeat {r + 1}/{args.repeats} done)", flush=True)
    arms = repeats[-1]  # the last repeat's guards: coverage, gaps, the guard's own measure
    by = {a.name: a for a in arms}
    params = sum(p.numel() for p in arms[0].model.parameters())
    image, caption = SHAPES[args.shape]
    image_tokens = (image // PATCH) ** 2
    tokens = image_tokens + caption
    print(
        f"\n== {load}: LLaVA {args.hidden}x{args.layers} + {args.hidden}x{args.layers}, {params / 1e6:.1f}M params, "
        f"batch {args.batch}, {args.shape} shape ({tokens} tokens a sample: {image_tokens} image + {caption}), "
        f"{args.repeats} repeats of {args.steps // args.repeats} timed steps per arm, fresh arms each"
        + (", a second process spinning on one core" if busy else ", nothing else of ours running")
        + (" (pinned apart: it on one core, training on the other)" if pinned else ""),
        flush=True,
    )
    after = os.getloadavg()
    print(
        f"  machine load (1-min average): {load_before[0]:.2f} before, {after[0]:.2f} after, on {os.cpu_count()} CPUs "
        "(ours: one process, one torch thread, plus the spinner when busy)"
    )
    # the figures' names carry the model when it is not the default one
    tag = load if (args.hidden, args.layers) == (HIDDEN, LAYERS) else f"{load}, LLaVA {args.hidden}x{args.layers}"
    attached = by["attached"].guard
    watch = attached.fuse.states["restore_weights"].watch if attached is not None else None
    grads = getattr(attached, "gradients", None)
    if grads is not None and grads.split:
        print(
            f"  gradient checks: {len(grads.split)} rotating groups, every MPU weight's gradient once in "
            f"{len(grads.split)} steps; {len(grads.found)} finding(s) in the clean run"
        )
    if watch is not None:
        print(
            f"  weight fingerprints: {len(watch.trained_keys)} rotating groups, every trained weight once in "
            f"{len(watch.trained_keys)} steps (coverage {1 / len(watch.trained_keys):.0%} of the bytes per window)"
        )
    if attached is not None:
        for mid, f in attached.checksum.figures().items():
            m = attached.mpu(mid)
            print(
                f"  checks, MPU {mid} ({m.name}): coverage {f['coverage_ratio']:.0%} of its layers in the last step, "
                f"largest gap between checks of a layer {f['max_gap_steps']:.0f} steps, "
                f"{f['replay_gap_steps']:.0f} steps between replays of its forward"
            )
        b = attached.budget.figures()
        print(
            f"  the guard's own measure: {b['overhead_ratio']:.2%} of its {b['step_s'] * 1e3:.0f} ms step (budget "
            f"{b['budget']:.0%}); by part: "
            + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(b["cost_s"].items()))
        )
        rep.figure(f"{tag}: guard's own overhead ratio", [b["overhead_ratio"]], unit="x", show=False)
        w, v = attached.fuse.states.get("restore_weights"), attached.fuse.snapshot_engine.verifier
        if w is not None and v.checked:
            every, each = attached.fuse.snapshot_engine.memory_every, v.cpu_s / v.checked
            read = w.verify_s / max(1, w.verifies)
            print(
                f"  snapshot verification: {v.checked}, {each * 1e3:.2f} ms CPU each on the copier's thread (rare work) "
                f"= {each / every / b['step_s']:.2%} of a step at 1 in {every}, {read * 1e3:.3f} ms on the training thread"
            )
    for k, a in enumerate(arms):
        rep.figure(f"{tag}: {a.name} step (wall)", [x for arm in repeats for x in arm[k].wall], unit="s")
        rep.figure(f"{tag}: {a.name} step (cpu)", [x for arm in repeats for x in arm[k].cpu], unit="s", show=False)

    def ratios(k: int, kind: str) -> list[float]:
        """Arm k against clip, one ratio of costs per repeat, round by round (see `paired`)."""
        return [
            paired(getattr(rr[k], kind), getattr(rr[0], kind), rr[k].rare, rr[k].charged, rr[0].rare) for rr in repeats
        ]

    rare = [sum(rr[2].charged) / len(rr[2].charged) / statistics.median(rr[0].cpu) for rr in repeats]
    print(
        f"  attached: rare work (replays, snapshot captures and copies), mean per step: {fmt_pct(rare)} of clip's step"
    )

    for kind in ("wall", "cpu"):
        control = ratios(1, kind)
        for k, a in enumerate(arms[2:], start=2):
            added = [x - 1 for x in ratios(k, kind)]
            if a.name in ("attached", "guard-only"):  # the default: judged against the budget
                rep.verdict(f"{tag}: {a.name} vs clip ({kind} time)", added, 0.01, at_most=True, control=control)
            else:  # a reference (incident mode, every weight): its cost, no target
                rep.figure(f"{tag}: {a.name} vs clip, added ({kind} time)", added, unit="x", show=False)
                print(f"  {tag + ': ' + a.name + ' vs clip (' + kind + ' time), reference':<52} {fmt_pct(added)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="timed steps per arm (split over the --repeats)")
    add_warmup_arg(ap)
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="repeats, each with freshly built arms; the verdict is on their median (>= 3)",
    )
    ap.add_argument("--load", default="idle,busy", help="idle, busy (a second process spinning on one core), or both")
    ap.add_argument("--full", action="store_true", help="add the every-weight reference arm (weight_groups=1)")
    ap.add_argument(
        "--no-incident",
        dest="incident",
        action="store_false",
        help="drop the incident-mode reference arm (every layer checked, every MPU replayed, every step)",
    )
    ap.add_argument(
        "--no-guard-only",
        dest="guard_only",
        action="store_false",
        help="drop the guard-only arm (one arm fewer a round: more rounds for the whole line's verdict)",
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default="realistic", help="tokens a sample (SHAPES)")
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--batch", type=int, default=8)
    add_json_arg(ap)
    args = ap.parse_args()
    if args.repeats < 3 or args.steps < args.repeats:
        ap.error("--repeats: at least 3, and --steps at least --repeats")
    loads = [x for x in args.load.split(",") if x]
    if not loads or set(loads) - {"idle", "busy"}:
        ap.error(f"--load: idle, busy or both, got {args.load!r}")
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(1)
    time_background_copies()
    rep = Report("attach_overhead", args.json)
    print("attach_overhead: the README's whole line on a Hugging Face LLaVA against the loop with clip_grad_norm_")
    for load in loads:
        run_load(load, args, rep)
        rep.write()  # after each load: a run stopped in its second load keeps the first's figures


if __name__ == "__main__":
    main()
