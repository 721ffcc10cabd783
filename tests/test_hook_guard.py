"""The Guard: MPU discovery, attach/detach, the plugin surface, riding on optimizer.step."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import mscale
from mscale.findings import Finding, Reason, Severity
from mscale.hook.core.attach import attach
from mscale.hook.core.guard import ModelInputs
from mscale.hook.core.mpu import MpuLayoutError, discover
from mscale.hook.core.null import NullGuard
from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal

CFG = TinyConfig()


def batches(n: int, seed: int = 0, size: int = 4):
    data = SyntheticCaptions(CFG, size=10_000, seed=seed)
    return [torch.utils.data.default_collate([data[i * size + j] for j in range(size)]) for i in range(n)]


def train(model, opt, bs, guard=None) -> list[float]:
    losses = []
    for b in bs:
        loss = model(b["images"], b["tokens"])["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


class HfLike(nn.Module):
    """Hugging Face nests the MPUs under `model.` (LlavaForConditionalGeneration)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.vision_tower = nn.Sequential(nn.Linear(4, 4))
        self.model.vision_tower.vision_model = nn.Linear(4, 4)  # nested: part of the vision MPU
        self.model.multi_modal_projector = nn.Linear(4, 4)
        self.model.language_model = nn.Linear(4, 4)
        self.lm_head = nn.Linear(4, 4)


def test_discovery_tinymm_and_hf_layout() -> None:
    mpus = discover(TinyMultimodal(CFG))
    assert [(m.mpu_id, m.name, m.path, m.gpu) for m in mpus] == [
        ("001", "vision", "vision_tower", 0),
        ("002", "aligner", "multi_modal_projector", 1),
        ("003", "text", "language_model", 2),
    ]
    assert all(m.device == torch.device("cpu") for m in mpus)
    hf = discover(HfLike())
    assert [(m.name, m.path) for m in hf] == [
        ("vision", "model.vision_tower"),
        ("aligner", "model.multi_modal_projector"),
        ("text", "model.language_model"),
    ]


def test_explicit_mapping_and_clear_errors() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(MpuLayoutError, match=r"no MPUs found in Sequential.*pass mpus=\{"):
        discover(model)
    mpus = discover(model, {"audio": model[0], "text": "1"}, gpus={"text": 6})
    assert [(m.mpu_id, m.name, m.path, m.gpu) for m in mpus] == [("001", "audio", "0", 0), ("002", "text", "1", 6)]
    with pytest.raises(MpuLayoutError, match="no sub-module at path 'nope'"):
        discover(model, {"text": "nope"})
    with pytest.raises(MpuLayoutError, match="same module"):
        discover(model, {"a": model[0], "b": "0"})
    with pytest.raises(MpuLayoutError, match="not a sub-module"):
        discover(model, {"a": nn.Linear(2, 2)})
    with pytest.raises(MpuLayoutError, match="unknown MPUs: vision"):
        discover(model, {"text": model[0]}, gpus={"vision": 1})


def test_three_lines_leave_training_identical_and_detach_restores() -> None:
    bs = batches(6)
    torch.manual_seed(0)
    ref_model = TinyMultimodal(CFG)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3)
    ref = train(ref_model, ref_opt, bs)

    torch.manual_seed(0)
    model = TinyMultimodal(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = mscale.attach(model, opt, job_id="same", connect=False, cmsa=False)
    got = train(model, opt, bs)
    assert got == ref  # watching changes nothing (CMSA off: clipping is the one thing that would)
    assert guard.current_step == 6 and guard.summary()["loss"] == pytest.approx(ref[-1])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters(), strict=True))
    guard.detach()
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_disabled_is_untouched(monkeypatch) -> None:
    model = TinyMultimodal(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = attach(model, opt, job_id="x", enabled=False)
    assert isinstance(g, NullGuard) and not g.enabled
    monkeypatch.setenv("MSCALE_GUARD", "0")
    assert isinstance(attach(model, opt, job_id="x"), NullGuard)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert not opt._optimizer_step_pre_hooks
    b = batches(1)[0]
    model(b["images"], b["tokens"])["loss"].backward()
    g.step()  # = optimizer.step()
    monkeypatch.setenv("MSCALE_GUARD", "maybe")
    with pytest.raises(ValueError, match="boolean"):
        attach(model, opt, job_id="x")


class Recorder:
    def __init__(self) -> None:
        self.calls = []
        self.guard = None

    def on_attach(self, guard) -> None:
        self.guard = guard
        self.calls.append(("attach",))

    def on_step_begin(self, step, batch) -> None:
        self.calls.append(("begin", step, type(batch).__name__, len(batch.args)))

    def on_mpu_output(self, mpu, inputs, output) -> None:
        self.calls.append(("output", mpu.name))

    def on_finding(self, finding) -> None:
        self.calls.append(("finding", finding.reason.value))

    def on_step_end(self, step, loss) -> None:
        self.calls.append(("end", step, round(loss, 4)))

    def on_command(self, command):
        self.calls.append(("command", command["type"], self.guard.step_state.in_step))

    def on_detach(self, guard) -> None:
        self.calls.append(("detach",))


class Broken:
    def on_step_begin(self, step, batch):
        raise RuntimeError("plugin bug")

    def on_step_end(self, step, loss):
        raise ZeroDivisionError


def test_plugin_order_and_isolation() -> None:
    torch.manual_seed(0)
    model = TinyMultimodal(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = Recorder()
    guard = attach(model, opt, job_id="p", connect=False, plugins=[Broken(), rec])
    losses = train(model, opt, batches(2))
    guard.emit(Finding("test", Reason.HEAL_ACTION, Severity.INFO, "from a plugin", {"mpu_id": "002"}))
    assert guard.findings[-1].labels == {"job_id": "p", "step": "2", "mpu_id": "002", "gpu": "1"}
    guard._commands.append({"type": "swap"})  # what the link thread does with a command
    train(model, opt, batches(1))
    guard.detach()
    assert guard.plugin_errors == 2 * 3  # Broken raised at each begin and end of 3 steps; they went on
    assert rec.calls[:7] == [
        ("attach",),
        ("begin", 0, "ModelInputs", 2),
        ("output", "vision"),
        ("output", "aligner"),
        ("output", "text"),
        ("end", 0, round(losses[0], 4)),
        ("begin", 1, "ModelInputs", 2),
    ]
    assert ("finding", "heal_action") in rec.calls
    # commands are dispatched at a step boundary, never mid-step
    assert ("command", "swap", True) not in rec.calls and rec.calls.index(("command", "swap", False)) < rec.calls.index(
        ("begin", 2, "ModelInputs", 2)
    )
    assert rec.calls[-1] == ("detach",)


def test_on_mpu_output_can_replace_and_request_skip() -> None:
    torch.manual_seed(0)
    model = TinyMultimodal(CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    class ZeroAligner:
        def on_mpu_output(self, mpu, inputs, output):
            assert isinstance(inputs, ModelInputs)
            return output * 0 if mpu.name == "aligner" else None

    class Skipper:
        def on_finding(self, f):
            if f.reason is Reason.LOSS_NONFINITE:
                guard.request_skip("nan loss")

    guard = attach(model, opt, job_id="r", connect=False, plugins=[ZeroAligner(), Skipper()], cmsa=False)
    b = batches(1)[0]
    out = model(b["images"], b["tokens"])
    assert torch.count_nonzero(out["projected"]) == 0
    out["loss"].backward()
    opt.step()
    opt.zero_grad()
    # a NaN loss: the plugin asks for the step to be skipped; the weights do not move
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(b["images"], b["tokens"])["loss"]
    (loss * float("nan")).backward()
    guard.observe(loss * float("nan"))
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert guard._report().skipped is True


def _logits_model() -> nn.Module:
    """Two MPUs and a forward that returns logits, not a loss: the loop computes the loss."""
    model = nn.Module()
    model.vision_tower = nn.Linear(8, 8)
    model.language_model = nn.Linear(8, 2)
    model.forward = lambda x: model.language_model(torch.relu(model.vision_tower(x)))
    return model


def test_explicit_step_with_a_plain_loss() -> None:
    """A model that returns logits: the loop gives the loss with guard.step(loss)."""
    model = _logits_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder()
    guard = attach(model, opt, job_id="plain", connect=False, plugins=[rec])
    for _ in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        guard.step(loss)
        opt.zero_grad()
    assert [c[1] for c in rec.calls if c[0] == "end"] == [0, 1, 2]
    assert guard.mpu("vision").forward_s > 0 and guard.mpu("001").backward_s > 0 and guard.mpu("text").grad_norm > 0


def test_importing_mscale_does_not_import_torch() -> None:
    code = "import sys, mscale; assert 'torch' not in sys.modules; print(sorted(mscale.__all__))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "attach" in out.stdout and "MscaleCallback" in out.stdout
    assert mscale.attach is attach
    with pytest.raises(AttributeError):
        mscale.nothing_here  # noqa: B018


def test_grad_scaler_overflow_still_ends_the_step_without_a_fault() -> None:
    """A GradScaler skips optimizer.step() on inf gradients; the guard ends such a step at
    scaler.update(). A finite loss with overflowing gradients is the scaler's business (it
    lowers the scale): no finding, the loss detector still sees the loss."""
    model = _logits_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    # the first scale overflows fp32 gradients; the back-off brings it to a usable one
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, backoff_factor=2.0**-100)
    rec = Recorder()
    guard = attach(model, opt, job_id="scaler", connect=False, plugins=[rec], scaler=scaler)
    steps_of_adam = []
    for _ in range(3):
        loss = 1000 * model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        guard.observe(loss)
        scaler.step(opt)
        scaler.update()
        steps_of_adam.append(int(opt.state[next(model.parameters())].get("step", 0)) if opt.state else 0)
    assert steps_of_adam == [0, 1, 2]  # the first step was skipped by the scaler
    assert [c[1] for c in rec.calls if c[0] == "end"] == [0, 1, 2]  # and still ended
    assert not [c for c in rec.calls if c[0] == "finding"]
    assert scaler.get_scale() == 2.0**27
    assert guard.loss_detector.series["loss"].seen == 3
    guard.detach()
    assert "update" not in scaler.__dict__ and not opt._optimizer_step_post_hooks


def test_a_watched_scaler_the_loop_never_calls_changes_nothing() -> None:
    """A scaler handed over (e.g. only to be snapshotted) but never used by the loop: steps still
    end at the optimizer step."""
    model = _logits_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder()
    guard = attach(model, opt, job_id="unused-scaler", connect=False, plugins=[rec], scaler=torch.amp.GradScaler("cpu"))
    for _ in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        guard.step(loss)
        opt.zero_grad()
    assert [c[1] for c in rec.calls if c[0] == "end"] == [0, 1, 2] and guard.current_step == 3
    guard.detach()
