"""One-line protection: `mscale.attach(..., snapshots=..., data=...)` on the tiny model, with
NaNs injected by the test's own hooks (not the project's injector). The documented code blocks
of docs/protect.md are run as they stand."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import mscale
from mscale.findings import Reason
from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal

CFG = TinyConfig()
DOC = Path(__file__).resolve().parent.parent / "docs" / "protect.md"
NAN = float("nan")


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)


class Pairs(torch.utils.data.Dataset):
    """SyntheticCaptions as the model's keyword arguments (images, tokens)."""

    def __init__(self, size: int = 4096) -> None:
        self.data = SyntheticCaptions(CFG, size=size, seed=0)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        item = self.data[i]
        return {"images": item["images"], "tokens": item["tokens"]}


class NanAt:
    """The test's own fault: a forward hook that makes the loss NaN at the given training
    forwards (counted from 0), and a record of which batch each forward saw."""

    def __init__(self, model: torch.nn.Module, calls: set[int]) -> None:
        self.calls, self.seen = calls, []
        model.register_forward_hook(self, with_kwargs=True)  # before attach: the guard sees the NaN

    def __call__(self, module, args, kwargs, out):
        if not module.training:
            return None
        self.seen.append(tuple(kwargs["tokens"].flatten()[:32].tolist()))
        if len(self.seen) - 1 in self.calls:
            return {**out, "loss": out["loss"] * NAN}
        return None


class Weights:
    """A plugin recording the weights at each step's begin and end (in the order they happen)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, list[torch.Tensor]]] = []

    def on_attach(self, guard) -> None:
        self.model = guard.model

    def _take(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]

    def on_step_begin(self, step, batch) -> None:
        self.events.append(("begin", step, self._take()))

    def on_step_end(self, step, loss) -> None:
        self.events.append(("end", step, self._take()))


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def all_finite(model: torch.nn.Module) -> bool:
    return all(torch.isfinite(p).all() for p in model.parameters())


def fresh(seed: int = 0):
    torch.manual_seed(seed)
    model = TinyMultimodal(CFG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_docs_one_line_protection_rolls_back_and_replays(tmp_path, monkeypatch) -> None:
    """The first block of docs/protect.md, as written: a NaN loss at step 13 rolls back to the
    in-memory snapshot of step 10, steps 11 and 12 are re-run on their batches, the faulty
    batch is stepped over, and the run ends where the uninterrupted run skipping that batch does."""
    block = python_blocks(DOC)[0]
    assert 'snapshots="checkpoints/run-42", data=loader' in block
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MSCALE_SOCKET", str(tmp_path / "no-agent.sock"))  # the block connects: to no agent
    model, optimizer = fresh()
    nan = NanAt(model, {13})
    ns = {"model": model, "optimizer": optimizer, "dataset": Pairs(), "total_steps": 20}
    exec(compile(block, f"{DOC.name} block", "exec"), ns)
    guard = ns["guard"]
    rollbacks = [f for f in guard.findings if f.reason is Reason.ROLLBACK]
    assert [(f.labels["step"], f.labels["tag"]) for f in rollbacks] == [("10", "memory")]
    assert guard.current_step == 20 and all_finite(model)
    seen = nan.seen
    assert len(seen) == 23  # 14 forwards up to the NaN, then steps 11..19 again
    assert seen[14:16] == seen[11:13]  # the replay sees the same batches
    assert seen[13] not in seen[14:]  # the faulty batch is stepped over
    assert (tmp_path / "checkpoints/run-42/step_00000000/manifest.json").exists()  # disk: every 100 steps

    # The uninterrupted run over the same batches (the faulty one skipped from the start):
    # the rollback made the run continue exactly as it would have.
    ref_model, ref_opt = fresh()
    loader = mscale.ResumableLoader(Pairs(), batch_size=8, seed=0)
    loader.skip_batch_at({"epoch": 0, "index": 13 * 8})
    ref = mscale.attach(ref_model, ref_opt, job_id="ref", snapshots=True, data=loader, connect=False)
    for batch in loader:
        if ref.current_step >= 20:
            break
        ref_model(**batch)["loss"].backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ref.detach()
    assert same(list(model.parameters()), list(ref_model.parameters()))


def test_docs_three_lines_drop_a_nan_step(tmp_path, monkeypatch) -> None:
    """The plain three lines (no snapshots): the NaN step's update never reaches the weights.
    The same loop unguarded is what the test guards against: NaN weights."""
    block = python_blocks(DOC)[1]
    assert 'mscale.attach(model, optimizer, job_id="run-42")' in block and "snapshots" not in block
    data = Pairs(64)
    loader = [torch.utils.data.default_collate([data[i * 4 + j] for j in range(4)]) for i in range(6)]

    monkeypatch.setenv("MSCALE_SOCKET", str(tmp_path / "no-agent.sock"))
    model, optimizer = fresh()
    NanAt(model, {3})
    after = []
    optimizer.register_step_post_hook(lambda *a: after.append([p.detach().clone() for p in model.parameters()]))
    ns = {"model": model, "optimizer": optimizer, "loader": loader}
    exec(compile(block, f"{DOC.name} block", "exec"), ns)
    guard = ns["guard"]
    assert all_finite(model)
    assert same(after[3], after[2]) and not same(after[4], after[3])  # step 3 dropped, step 4 applied
    assert int(optimizer.state[next(model.parameters())]["step"]) == 5  # Adam counted 5 updates, not 6
    assert any(f.reason is Reason.LOSS_NONFINITE and f.labels["step"] == "3" for f in guard.findings)
    assert guard.fuse is None and guard.snapshots is None and guard.current_step == 6

    unguarded, opt2 = fresh()
    NanAt(unguarded, {3})
    guard_off = mscale.attach(unguarded, opt2, job_id="off", enabled=False)
    for batch in loader:
        loss = unguarded(**batch)["loss"]
        loss.backward()
        opt2.step()
        opt2.zero_grad()
    guard_off.detach()
    assert not all_finite(unguarded)


def test_a_nan_gradient_with_a_finite_loss_is_dropped_too() -> None:
    model, optimizer = fresh()
    w = model.language_model.lm_head.weight
    hits = []
    w.register_hook(lambda g: g * NAN if len(hits) == 2 else None)
    optimizer.register_step_pre_hook(lambda *a: hits.append(1))
    guard = mscale.attach(model, optimizer, job_id="grad", connect=False)
    data = Pairs(64)
    before = None
    for i in range(4):
        batch = torch.utils.data.default_collate([data[i * 4 + j] for j in range(4)])
        if i == 2:
            before = [p.detach().clone() for p in model.parameters()]
        model(**batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
        if i == 2:
            assert same(before, [p.detach() for p in model.parameters()])
    assert all_finite(model)
    assert not any(f.reason is Reason.LOSS_NONFINITE for f in guard.findings)  # the loss stayed finite
    assert any(f.reason is Reason.GRAD_NORM_NONFINITE and f.labels["step"] == "2" for f in guard.findings)
    guard.detach()


def _stateful_loader(seed: int = 0):
    from torchdata.stateful_dataloader import StatefulDataLoader

    g = torch.Generator().manual_seed(seed)
    return StatefulDataLoader(Pairs(), batch_size=8, shuffle=True, generator=g)


def test_stateful_dataloader_rollback_restores_the_weights_and_the_loop_moves_on() -> None:
    pytest.importorskip("torchdata")
    model, optimizer = fresh()
    nan = NanAt(model, {13})
    weights = Weights()
    loader = _stateful_loader()
    guard = mscale.attach(model, optimizer, job_id="sdl", snapshots=True, data=loader, connect=False, plugins=[weights])
    assert guard.snapshots.directory is None  # in memory only
    for batch in loader:
        if guard.current_step >= 20:
            break
        model(**batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    guard.detach()
    assert [f.labels["step"] for f in guard.findings if f.reason is Reason.ROLLBACK] == ["10"]
    assert all_finite(model) and guard.current_step == 20
    seen = nan.seen
    assert len(seen) == 23 and len(set(seen)) == 23  # nothing replayed: the loop went on
    ends = {s: w for kind, s, w in weights.events[: 2 * 14] if kind == "end"}
    begins_after = [(s, w) for kind, s, w in weights.events[2 * 14 :] if kind == "begin"]
    assert begins_after[0][0] == 11 and same(begins_after[0][1], ends[10])  # rolled back to step 10


def test_stateful_dataloader_resumes_after_a_restart(tmp_path) -> None:
    pytest.importorskip("torchdata")
    snaps = mscale.SnapshotConfig(directory=tmp_path / "ckpt", disk_every=5)
    model, optimizer = fresh()
    nan = NanAt(model, set())
    weights = Weights()
    loader = _stateful_loader()
    guard = mscale.attach(
        model, optimizer, job_id="restart", snapshots=snaps, data=loader, connect=False, plugins=[weights]
    )
    for batch in loader:
        if guard.current_step >= 13:
            break
        model(**batch)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    guard.detach()  # the queued writes finish
    after_10 = [w for kind, s, w in weights.events if kind == "end" and s == 10][0]

    # a new process would build everything afresh: other weights, a loader at its start
    model2, optimizer2 = fresh(seed=1)
    nan2 = NanAt(model2, set())
    loader2 = _stateful_loader()
    guard2 = mscale.attach(model2, optimizer2, job_id="restart", snapshots=snaps, data=loader2, connect=False)
    assert guard2.current_step == 11
    assert same(list(model2.parameters()), after_10)
    batch = next(iter(loader2))
    model2(**batch)["loss"].backward()
    optimizer2.step()
    assert nan2.seen[0] == nan.seen[11]  # the data goes on at step 11's batch
    assert [f.labels["step"] for f in guard2.findings if f.reason is Reason.SNAPSHOT_RESUMED] == ["10"]
    guard2.detach()

    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model2.modules())
    with pytest.raises(ValueError, match="already holds snapshots"):
        mscale.attach(model2, optimizer2, job_id="restart", snapshots=snaps, data=loader2, connect=False, resume=False)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model2.modules()) == hooks
    assert not optimizer2._optimizer_step_pre_hooks  # the refused attach took its hooks back off


def test_bad_arguments_are_refused_before_anything_is_hooked() -> None:
    model, optimizer = fresh()

    def hooks() -> int:
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())

    n = hooks()
    plain = torch.utils.data.DataLoader(Pairs(64), batch_size=8)
    with pytest.raises(TypeError, match="DataLoader has no state_dict"):
        mscale.attach(model, optimizer, job_id="x", snapshots=True, data=plain, connect=False)
    with pytest.raises(TypeError, match="snapshots: expected a directory, True"):
        mscale.attach(model, optimizer, job_id="x", snapshots=42, connect=False)
    with pytest.raises(TypeError, match="data= without snapshots=: .* Add snapshots=True"):
        mscale.attach(model, optimizer, job_id="x", data=mscale.ResumableLoader(Pairs(64), batch_size=8), connect=False)
    with pytest.raises(ValueError, match="memory_every"):
        mscale.attach(model, optimizer, job_id="x", snapshots=mscale.SnapshotConfig(memory_every=0), connect=False)
    assert hooks() == n and not optimizer._optimizer_step_pre_hooks


def test_data_without_snapshots_is_refused_naming_what_to_do_and_nothing_is_hooked():
    model = TinyMultimodal(CFG)
    loader = mscale.ResumableLoader(Pairs(64), batch_size=4)
    with pytest.raises(TypeError, match=r"data= without snapshots=.*snapshots=True"):
        mscale.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), job_id="j", data=loader, connect=False)
    assert not model._forward_pre_hooks and not model._forward_hooks
