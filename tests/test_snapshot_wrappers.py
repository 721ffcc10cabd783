"""Snapshots keyed by the unwrapped model's names: a job restarted under another wrapper resumes
at the snapshot's step with the weights and the optimizer state bitwise those saved. 2 DDP gloo
ranks (forked by tests/support/world_job.py) restarted as the plain model on 1 process, and the
plain model restarted under DDP on 2 ranks, on the tiny LLaVA with the README's protection line;
a snapshot written before, with DDP's `module.` prefix in its names, still loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_world_size import FIRST, SECOND, run, visible


def restart(tmp_path: Path, before: tuple[int, str], after: tuple[int, str]) -> None:
    directory = tmp_path / "snaps"
    first = run(tmp_path, "first", world=before[0], steps=FIRST, directory=directory, wrap=before[1])
    second = run(tmp_path, "second", world=after[0], steps=SECOND, directory=directory, wrap=after[1])
    for r in second:
        assert "error" not in r, r
        assert r["start"] == 9, r["resumed"]  # the snapshot of step 8, not a start from scratch
        assert r["start_hash"] == first[0]["hashes"]["8"]  # bitwise the weights saved
        assert r["start_optimizer_hash"] == first[0]["optimizer_hashes"]["8"]  # and the optimizer state
        assert any(f"written by {before[0]} rank(s), resumed on {after[0]}" in m for m in r["resumed"]), r["resumed"]
    visible(directory)


def test_ddp_on_2_ranks_restarted_as_the_plain_model_on_1(tmp_path: Path) -> None:
    restart(tmp_path, (2, "ddp"), (1, "plain"))


@pytest.mark.slow
def test_the_plain_model_restarted_under_ddp_on_2_ranks(tmp_path: Path) -> None:
    restart(tmp_path, (1, "plain"), (2, "ddp"))


class Holder(torch.nn.Module):
    """Holds the model as `module`: its names are those a DDP-wrapped model's snapshots had
    (`module.lm_head.weight`, ...) before snapshots took the unwrapped model's."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.module = model


def test_a_snapshot_with_a_wrappers_prefix_still_loads_into_the_plain_and_the_compiled_model(tmp_path: Path) -> None:
    from mscale.snapshot.config import SnapshotConfig
    from mscale.snapshot.engine import SnapshotEngine
    from support.tiny_hf import tiny_llava

    model, make_batch = tiny_llava(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for s in range(2):  # optimizer state to save
        model(**make_batch(s, torch.Generator().manual_seed(s))).loss.backward()
        opt.step()
        opt.zero_grad()
    old = SnapshotEngine(Holder(model), opt, config=SnapshotConfig(directory=tmp_path))
    old.step_end(2)
    old.save(wait=True, timeout=60)
    old.close()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    written = {
        k for f in (tmp_path / "step_00000002").glob("*.safetensors") for k in _keys(f) if k.startswith("model/")
    }
    assert "model/module.lm_head.weight" in written  # the old names

    for compiled in (False, True):
        fresh, _ = tiny_llava(1)  # other weights
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        outer = torch.compile(fresh) if compiled else fresh  # the wrapper is never run: nothing is traced
        engine = SnapshotEngine(outer, fresh_opt, config=SnapshotConfig(directory=tmp_path))
        assert engine.resume() == 2, [f.message for f in engine.findings]
        assert all(torch.equal(v, saved[k]) for k, v in fresh.state_dict().items())
        for p, held in zip(fresh.parameters(), saved_opt, strict=True):
            assert fresh_opt.state[p].keys() == held.keys()
            assert all(torch.equal(fresh_opt.state[p][k], held[k]) for k in held)
        engine.close()


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(f.keys())


@pytest.mark.parametrize(
    "saved, live",
    [
        ("module.lm_head.weight", "lm_head.weight"),  # DDP
        ("_orig_mod.lm_head.weight", "lm_head.weight"),  # torch.compile
        ("module._orig_mod.model.vision_tower.w", "model.vision_tower.w"),  # DDP around compile
        ("model._fsdp_wrapped_module.layers.0.w", "model.layers.0.w"),  # an FSDP1-wrapped submodule
        ("lm_head.weight", "_orig_mod.lm_head.weight"),  # and back
    ],
)
def test_names_that_differ_only_by_wrappers_are_renamed_and_others_left_for_the_fit_check(saved, live) -> None:
    from mscale.snapshot.keys import renamed

    t = torch.zeros(1)
    tensors = {"f": {f"model/{saved}": t, f"optim/{saved}/exp_avg": t, "model/other": t}}
    objects = {"optimizer": {"param_groups": [{"params": [saved]}], "scalars": {saved: {"step": 1}}}}
    out, objs = renamed(tensors, objects, {live, "other"}, {live})
    assert set(out["f"]) == {f"model/{live}", f"optim/{live}/exp_avg", "model/other"}
    assert objs["optimizer"]["param_groups"][0]["params"] == [live] and set(objs["optimizer"]["scalars"]) == {live}
    # a name that is not the same tensor under another wrapper stays: the fit check names it
    out, _ = renamed({"f": {"model/module.head.bias": t}}, {}, {"lm_head.bias"}, set())
    assert set(out["f"]) == {"model/module.head.bias"}


def test_a_ddp_models_snapshot_holds_the_bare_names_and_a_partial_restore_takes_ddps(tmp_path: Path) -> None:
    """Under DDP (one gloo rank in this process) the snapshot names the model's own tensors; the
    partial restore (a weight repair, an L1 swap) is asked by DDP's names and finds them."""
    import torch.distributed as dist

    from mscale.snapshot.engine import SnapshotEngine
    from support import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        ddp(torch.randn(2, 4)).sum().backward()
        opt.step()
        engine = SnapshotEngine(ddp, opt)
        snap = engine.snapshot(step=1)
        snap.wait_ready()
        names = {k for d in snap.tensors.values() for k in d}
        assert {"model/weight", "model/bias", "optim/weight/exp_avg"} <= names
        assert not [k for k in names if "module." in k]
        saved, saved_avg = model.weight.detach().clone(), opt.state[model.weight]["exp_avg"].clone()
        with torch.no_grad():
            model.weight.mul_(-3.0)  # the test's own corruption of a weight and its state
            opt.state[model.weight]["exp_avg"].add_(1.0)
        assert snap.copy_back(ddp, opt, lambda _file, name: name == "module.weight") == 1
        assert torch.equal(model.weight, saved) and torch.equal(opt.state[model.weight]["exp_avg"], saved_avg)
        engine.close()
    finally:
        dist.destroy_process_group()
