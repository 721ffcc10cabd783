"""Issue 25 item 7: a snapshot fits what it restores into. Every tensor's dtype and shape is
checked against the live model and optimizer before any byte is applied, and the optimizer
state for completeness; a mismatch refuses that snapshot naming the tensor and both shapes or
dtypes, and resume falls back to the previous good one. The everyday form: a snapshot written by
another version of the model (here: the same job in another dtype, or its optimizer state
changed before the write) in the same directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from mscale.findings import Reason
from support.tiny_snapshot_job import job, train


def written_at_10(directory: Path) -> dict[str, torch.Tensor]:
    """The right job writes step 10 and stops; its state at step 10."""
    model, opt, engine = job(directory)
    train(model, opt, engine, 1, 10)
    engine.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


def transpose_exp_avg(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    st = opt.state[model.vision.weight]
    st["exp_avg"] = st["exp_avg"].t().contiguous()


def drop_exp_avg_sq(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    del opt.state[model.vision.weight]["exp_avg_sq"]


def int32_buffer(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model.scale = model.scale.view(torch.int32)  # float32 bytes labelled int32: about 1.07e9 each


@pytest.mark.parametrize(
    "dtype,change,words",
    [
        (torch.float16, None, ["does not fit the model: model/", "dtype torch.float16", "dtype torch.float32"]),
        (torch.bfloat16, None, ["does not fit the model: model/", "dtype torch.bfloat16", "dtype torch.float32"]),
        (torch.float64, None, ["does not fit the model: model/", "dtype torch.float64", "dtype torch.float32"]),
        (torch.float32, int32_buffer, ["model/scale", "torch.int32", "torch.float32"]),
        (torch.float32, transpose_exp_avg, ["optim/vision.weight/exp_avg", "shape (4, 3)", "shape (3, 4)"]),
        (torch.float32, drop_exp_avg_sq, ["optim/vision.weight", "lacks ['exp_avg_sq']"]),
    ],
    ids=["float16", "bfloat16", "float64", "int32_labelled", "optim_transposed", "optim_missing"],
)
def test_a_snapshot_that_does_not_fit_is_refused_naming_it_and_resume_falls_back(
    tmp_path: Path, dtype, change, words
) -> None:
    at10 = written_at_10(tmp_path)
    # another version of the job writes step 20 in the same directory
    model, opt, engine = job(tmp_path, dtype=dtype, seed=1)
    train(model, opt, engine, 11, 19)
    if change is not None:
        change(model, opt)
    engine.snapshot(20)
    engine.save(wait=True, timeout=60)
    engine.close()
    # the right job resumes: step 20 refused with the tensor and both sides named, step 10 taken
    model, opt, engine = job(tmp_path, seed=2)
    try:
        assert engine.resume() == 10
        refused = [f for f in engine.findings if f.reason is Reason.SNAPSHOT_REFUSED]
        assert len(refused) == 1 and refused[0].labels["step"] == "20", [f.message for f in refused]
        assert all(w in refused[0].message for w in words), refused[0].message
        assert all(torch.equal(v, at10[k]) for k, v in model.state_dict().items())
        train(model, opt, engine, 11, 12)  # the next steps run: nothing half-loaded
    finally:
        engine.close()


def test_nothing_is_applied_when_the_only_snapshot_does_not_fit(tmp_path: Path) -> None:
    model, opt, engine = job(tmp_path, dtype=torch.float16, seed=1)
    train(model, opt, engine, 1, 10)
    engine.close()
    model, opt, engine = job(tmp_path, seed=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        assert engine.resume() is None
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        assert not opt.state  # no optimizer state either
        messages = [f.message for f in engine.findings if f.reason is Reason.SNAPSHOT_REFUSED]
        assert any("torch.float16" in m for m in messages) and any("starting from scratch" in m for m in messages)
    finally:
        engine.close()


def test_a_snapshot_that_fits_still_resumes_exactly(tmp_path: Path) -> None:
    at10 = written_at_10(tmp_path)
    model, opt, engine = job(tmp_path, seed=3)
    try:
        assert engine.resume() == 10
        assert all(torch.equal(v, at10[k]) for k, v in model.state_dict().items())
        assert not [f for f in engine.findings if f.reason is Reason.SNAPSHOT_REFUSED]
    finally:
        engine.close()
