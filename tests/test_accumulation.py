"""Gradient accumulation with a bad sample: the README's protection line on a tiny LLaVA, 4
micro-batches a step, NaN pixels written into the test's own data set. A rollback steps over
exactly the poisoned micro-batch (or every micro-batch of the step when no loss says which),
its event says which, and the data is blamed, not the MPUs."""

from __future__ import annotations

import torch

import mscale
from mscale.findings import Reason
from support.tiny_hf import tiny_llava

ACC, BS = 4, 2
STEPS = 30
# (step, micro-batch): one poisoned micro-batch in each of the 4 positions. Each rollback
# before it stepped over one batch, so the k-th poisoned step's batches start k batches later.
POISONED = [(5, 0), (12, 1), (18, 2), (25, 3)]


class Captions(torch.utils.data.Dataset):
    """The tiny LLaVA's samples, one per index; `poison` indices have NaN pixels. `drawn`
    counts how often each poisoned sample is read."""

    def __init__(self, make_batch, poison: set[int]) -> None:
        self.make_batch, self.poison = make_batch, poison
        self.drawn: dict[int, int] = {}

    def __len__(self) -> int:
        return 512

    def __getitem__(self, i: int) -> dict:
        sample = {k: v[0] for k, v in self.make_batch(i, torch.Generator().manual_seed(i)).items()}
        if i in self.poison:
            self.drawn[i] = self.drawn.get(i, 0) + 1
            sample["pixel_values"] = sample["pixel_values"] * float("nan")
        return sample


def test_a_poisoned_micro_batch_in_each_position_costs_one_rollback_and_blames_the_data():
    model, make_batch = tiny_llava(seed=0)
    poison = {(step * ACC + micro + k) * BS + k % BS for k, (step, micro) in enumerate(POISONED)}
    data = Captions(make_batch, poison)
    loader = mscale.ResumableLoader(data, batch_size=BS, shuffle=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = mscale.attach(
        model, opt, job_id="acc", snapshots=mscale.SnapshotConfig(memory_every=5), data=loader, connect=False
    )
    batches, calls = iter(loader), 0
    while guard.current_step < STEPS and calls < 2 * STEPS:  # a loop stuck on the bad sample ends too
        for _ in range(ACC):
            (model(**next(batches)).loss / ACC).backward()
        opt.step()
        opt.zero_grad()
        calls += 1
    rollbacks = guard.fuse.states["rollback"].rollbacks
    findings = list(guard.findings)
    guard.detach()

    assert guard.current_step == STEPS
    assert [r["step"] for r in rollbacks] == [s for s, _ in POISONED]  # one rollback per poisoned step
    assert all(r["to"] is not None for r in rollbacks)
    assert data.drawn == {i: 1 for i in poison}  # stepped over on every replay: never drawn again
    bad_inputs = [f for f in findings if f.reason is Reason.INPUT_NONFINITE]
    assert [(int(f.labels["step"]), int(f.labels["micro_batch"])) for f in bad_inputs] == POISONED
    assert {f.labels["input"] for f in bad_inputs} == {"pixel_values"}
    # the data's fault: no MPU output check fails, no MPU is suspect
    assert not [f for f in findings if f.reason in (Reason.NONFINITE_OUTPUT, Reason.CHECKSUM_FAILURE)]
    assert {m.fuse_level for m in guard.mpus} == {"healthy"}
    applied = [f for f in findings if f.reason is Reason.HEAL_ACTION and f.labels.get("result") == "applied"]
    assert len(applied) == len(POISONED)
    for f, k in zip(applied, range(len(POISONED)), strict=True):
        step, micro = POISONED[k]
        index = (step * ACC + micro + k) * BS
        assert f"1 micro-batch of step {step} skipped (epoch 0, index {index})" in f.message
    # one heal event per rollback: the dropped update and the restore are one event, not two
    rolled = [f for f in findings if f.reason is Reason.HEAL_ACTION and f.labels.get("action") == "rollback"]
    assert [f.labels["result"] for f in rolled] == ["applied"] * len(POISONED)
    assert all(
        f"the update of step {s} dropped, restored step" in f.message
        for f, (s, _) in zip(rolled, POISONED, strict=True)
    )
    # one heal event per decision: no in-process duplicates for the loss and gradient findings
    assert not [f for f in findings if f.reason is Reason.HEAL_ACTION and f.labels.get("result") == "duplicate"]


def test_a_non_finite_step_no_loss_names_steps_over_every_micro_batch():
    """A NaN gradient with finite losses (nothing says which micro-batch): all 4 are skipped."""
    from mscale.snapshot.config import SnapshotConfig
    from mscale.snapshot.engine import SnapshotEngine

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = mscale.ResumableLoader(torch.arange(64.0).view(32, 2), batch_size=2, shuffle=False)
    engine = SnapshotEngine(model, opt, config=SnapshotConfig(memory_every=1), data=loader)
    engine.snapshot(step=0)
    engine.step_end(0)
    for _ in range(ACC):
        loader.next_batch()
    drawn = [dict(p) for p in loader.step_positions]
    assert [p["index"] for p in drawn] == [0, 2, 4, 6]
    assert engine.rollback(skip_batch=True) == 0
    assert engine.last_skipped == drawn
    first = loader.next_batch()
    assert first.tolist() == [[16.0, 17.0], [18.0, 19.0]]  # indices 8, 9: the 4 micro-batches stepped over
    # with the non-finite micro-batch named (its loss), only that one is stepped over
    engine.step_end(1)
    engine.snapshot(step=1)
    for _ in range(ACC):
        loader.next_batch()
    engine.rollback(skip_batch=True, micro_batches=[2])
    assert [p["index"] for p in engine.last_skipped] == [14]
    engine.close()
