"""One training run of a fault campaign: a tiny Hugging Face model (tests/support/tiny_hf.py)
under the README's line, `mscale.attach(model, opt, job_id=..., snapshots=True, data=loader)`,
or left alone (no guard), with at most one fault from the campaign's own injector.

The loop is the README's, with the step read from the guard (a rollback moves it back); it
stops at the target step or after `max_calls` optimizer calls (a loop), whatever the healing
does. What comes back: the calls and steps made, every finding with its step, the MPUs the
guard found, the weights' state and the held-out task loss of the weights at the end.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import mscale  # noqa: E402
from benchmarks._campaign_inject import Injector  # noqa: E402
from benchmarks._campaign_schema import Fault  # noqa: E402
from support.fuse_runs import held_out_loss  # noqa: E402
from support.tiny_hf import Samples, tiny_llava, tiny_qwen2vl  # noqa: E402

LR = 3e-3
SAMPLES = 512
MODELS = ("llava", "qwen2vl")


def build(name: str, seed: int) -> tuple[torch.nn.Module, Any]:
    if name == "llava":
        return tiny_llava(seed=seed)
    if name == "qwen2vl":
        return tiny_qwen2vl(seed=seed, normalize=True)
    raise ValueError(f"model {name!r}: the campaign runner knows {list(MODELS)}")


def _labels(f: Any) -> dict[str, str]:
    return {k: (v.value if hasattr(v, "value") else str(v)) for k, v in dict(f.labels).items()}


def run(
    model_name: str,
    fault: Fault | None,
    *,
    guarded: bool,
    steps: int,
    max_calls: int,
    seed: int = 0,
    rank: int = 0,
    world: int = 1,
) -> dict:
    """One run (one rank's, in a process group of `world` gloo ranks under DDP: the fault only
    on its target rank); never raises for what the training does (its error is in the result)."""
    torch.manual_seed(seed)
    model, make_batch = build(model_name, seed)
    call = model if world == 1 else torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(call.parameters(), lr=LR)
    loader = _loader(model_name, make_batch, seed, rank, world)
    findings: list[dict] = []
    out: dict[str, Any] = {"guarded": guarded, "error": None, "capped": False}
    guard: Any = None

    class Keep:
        def on_finding(self, f: Any) -> None:
            at = f.labels.get("step")
            step = int(at) if str(at).isdigit() else guard.current_step
            sev = f.severity.value
            labels = _labels(f)
            findings.append({"step": step, "reason": f.reason.value, "severity": sev, "labels": labels, "rank": rank})

    t0, made, inj = time.perf_counter(), [0], None  # made: the optimizer calls, kept if the run raises
    try:
        if guarded:
            guard = mscale.attach(
                call, opt, job_id="campaign", snapshots=True, data=loader, connect=False, plugins=[Keep()]
            )
            out["mpus"] = {m.mpu_id: {"name": m.name, "path": m.path} for m in guard.mpus}
        inj = Injector(fault, model, opt, seed) if fault is not None and fault.rank == rank else None
        _train(call, opt, loader, guard, inj, steps, max_calls, made)
        out["capped"] = made[0] >= max_calls and _step(guard, made[0]) < steps
    except Exception as e:  # what the run did is the result, whatever it is
        tb = traceback.extract_tb(e.__traceback__)
        where = [f"{Path(x.filename).name}:{x.lineno}" for x in tb[-4:]]
        out["error"] = {"type": f"{type(e).__module__}.{type(e).__name__}", "message": str(e)[:400], "where": where}
    if inj is not None:
        out["armed"] = inj.armed
        inj.remove()
    out.update(calls=made[0], steps=_step(guard, made[0]), findings=findings)
    if guard is not None:
        guard.detach()
    out.update(_weights(model, make_batch))
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


class Batches(torch.utils.data.Dataset):
    """Whole batches as items: Qwen2-VL's pixels are one row per patch of the whole batch (and
    its grid one row per image), which a per-sample collate cannot put back together."""

    def __init__(self, make_batch: Any, size: int) -> None:
        self.make_batch, self.size = make_batch, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        return self.make_batch(i, torch.Generator().manual_seed(i))


def _first(items: list) -> Any:
    return items[0]


def _loader(model_name: str, make_batch: Any, seed: int, rank: int, world: int) -> mscale.ResumableLoader:
    if model_name == "qwen2vl":
        data = Batches(make_batch, SAMPLES // 4)
        return mscale.ResumableLoader(data, batch_size=1, seed=seed, rank=rank, world_size=world, collate_fn=_first)
    data = Samples(make_batch, SAMPLES)
    return mscale.ResumableLoader(data, batch_size=4 // world, seed=seed, rank=rank, world_size=world)


def _step(guard: Any, calls: int) -> int:
    return int(guard.current_step) if guard is not None else calls


def _train(model, opt, loader, guard, inj, steps: int, max_calls: int, made: list[int]) -> None:
    """The README's loop; made[0] counts the optimizer calls."""
    while True:
        for batch in loader:
            step = _step(guard, made[0])
            if step >= steps or made[0] >= max_calls:
                return
            if inj is not None:
                inj.begin(step)
                batch = inj.batch(batch)
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            made[0] += 1


def _weights(model: torch.nn.Module, make_batch: Any) -> dict:
    with torch.no_grad():
        ps = [p.detach() for p in model.parameters()]
        finite = all(bool(torch.isfinite(p).all()) for p in ps)
        biggest = max(float(p.abs().max()) for p in ps) if finite else float("inf")
    try:
        loss = held_out_loss(model, make_batch)
    except Exception as e:
        return {"finite": finite, "max_abs": biggest, "held_out": None, "held_out_error": str(e)[:200]}
    return {"finite": finite, "max_abs": biggest, "held_out": loss}
