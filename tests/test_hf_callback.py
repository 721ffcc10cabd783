"""The Trainer callback on a real tiny LlavaForConditionalGeneration (random weights, nothing
downloaded) trained for a few steps on CPU by the real Hugging Face Trainer."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    Trainer,
)

import mscale  # noqa: E402
from mscale.findings import Reason  # noqa: E402
from mscale.healing.settings import HealingSection  # noqa: E402
from mscale.hook.core.guard import Guard  # noqa: E402
from mscale.sim.inject import inject  # noqa: E402
from support.hf_trainer import cpu_args  # noqa: E402

IMAGE_TOKEN = 127
PATCHES = (16 // 4) ** 2


def tiny_llava() -> LlavaForConditionalGeneration:
    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=16,
        patch_size=4,
        projection_dim=32,
    )
    text = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=128,
        max_position_embeddings=64,
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
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        pixels = torch.rand(3, 16, 16, generator=g)
        text = (pixels.mean(dim=(0, 2))[:6] * 100).long()
        ids = torch.cat([torch.full((PATCHES,), IMAGE_TOKEN), text])
        return {"input_ids": ids, "pixel_values": pixels, "labels": ids.masked_fill(ids == IMAGE_TOKEN, -100)}


class Watch:
    def __init__(self) -> None:
        self.guard = None
        self.ends = []
        self.findings = []

    def on_attach(self, guard) -> None:
        self.guard = guard

    def on_step_end(self, step, loss) -> None:
        self.ends.append((step, loss))

    def on_finding(self, f) -> None:
        self.findings.append(f)


def test_trainer_callback_on_tiny_llava(tmp_path) -> None:
    model = tiny_llava()
    watch = Watch()
    injected = {}

    class Inject:
        """Corrupt the projector at step 3 from inside the run (what a faulty GPU would do)."""

        def on_step_begin(self, step, batch) -> None:
            if step == 3:
                injected["i"] = inject(watch.guard, kind="exponent_flip", mpu="aligner", steps=1)

    # a transient fault in one step: every layer checked every step, so it is caught in that
    # step whatever the rotation (tests/test_checksum_budget.py tests the rotation)
    full = mscale.ChecksumConfig(full=True)
    # healing= reaches the gradient check too, not only the fuse
    healing = HealingSection(gradient_groups=3)
    callback = mscale.MscaleCallback(
        job_id="llava", connect=False, plugins=[watch, Inject()], checksum=full, healing=healing
    )
    args = cpu_args(tmp_path, 6, 2, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=Captions(), callbacks=[callback])
    trainer.train()
    guard = callback.guard
    assert isinstance(guard, Guard)
    assert guard.gradients.groups == 3  # the callback's healing=
    assert [(m.mpu_id, m.name, m.path) for m in guard.mpus] == [
        ("001", "vision", "model.vision_tower"),
        ("002", "aligner", "model.multi_modal_projector"),
        ("003", "text", "model.language_model"),
    ]
    assert [s for s, _ in watch.ends] == [0, 1, 2, 3, 4, 5]
    assert all(loss is not None for _, loss in watch.ends[:3])
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert watch.ends[0][1] == pytest.approx(logged[0], rel=1e-4)  # the loss the Trainer saw
    assert injected["i"].hits and injected["i"].hits[0].step == 3
    caught = [
        f
        for f in watch.findings
        if f.reason in (Reason.CHECKSUM_FAILURE, Reason.NONFINITE_OUTPUT) and f.labels["mpu"] == "aligner"
    ]
    assert caught and caught[0].labels["step"] == "3"
    assert all(m.forward_s > 0 and m.checksum_checks_total >= 6 for m in guard.mpus)
    # detached at the end of training: once the test's injector is off, the model is as it was
    injected["i"].remove()
    ours = [
        (n, fn)
        for n, m in model.named_modules()
        for fn in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
        if getattr(fn, "__module__", "").startswith("mscale")
    ]  # transformers keeps hooks of its own
    assert ours == []


class Weights:
    """Records the weights at each step's begin and end, in the order they happen."""

    def __init__(self) -> None:
        self.events = []

    def on_attach(self, guard) -> None:
        self.model = guard.model

    def on_step_begin(self, step, batch) -> None:
        self.events.append(("begin", step, [p.detach().clone() for p in self.model.parameters()]))

    def on_step_end(self, step, loss) -> None:
        self.events.append(("end", step, [p.detach().clone() for p in self.model.parameters()]))


def test_trainer_rolls_back_a_nan_step(tmp_path) -> None:
    """snapshots= under the real Trainer: a NaN loss at step 3, made by the test's own forward
    hook, rolls the model and optimizer back to the snapshot of step 2; the Trainer goes on to
    its last step, and every weight is finite."""
    model = tiny_llava()
    forwards = []

    def nan_at_step_3(module, args, output):
        if module.training:
            forwards.append(1)
            if len(forwards) == 4:
                output.loss = output.loss * float("nan")
        return output

    model.register_forward_hook(nan_at_step_3)
    watch, rec = Watch(), Weights()
    snapshots = mscale.SnapshotConfig(directory=tmp_path / "snapshots", memory_every=2, disk_every=2)
    callback = mscale.MscaleCallback(job_id="llava-nan", connect=False, plugins=[watch, rec], snapshots=snapshots)
    args = cpu_args(tmp_path / "out", 8, 2, logging_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=Captions(), callbacks=[callback])
    trainer.train()
    guard = callback.guard
    assert trainer.state.global_step == 8 and len(forwards) == 8  # to the end, no step re-run
    assert all(torch.isfinite(p).all() for p in model.parameters())
    rollbacks = [f for f in watch.findings if f.reason is Reason.ROLLBACK]
    assert [(f.labels["step"], f.labels["from_step"]) for f in rollbacks] == [("2", "2")]
    healed = [f for f in watch.findings if f.reason is Reason.HEAL_ACTION and f.labels.get("action") == "rollback"]
    assert healed and healed[-1].labels.get("result") == "applied"
    ends = {s: w for kind, s, w in rec.events if kind == "end"}
    begin_4 = [w for kind, s, w in rec.events if kind == "begin" and s == 4]
    # the step after the NaN starts from the snapshot of step 2 (step 3's update dropped)
    assert len(begin_4) == 1 and all(torch.equal(a, b) for a, b in zip(begin_4[0], ends[2], strict=True))
    assert [s for s, _ in watch.ends] == list(range(8))  # the guard's steps follow the Trainer's
    assert guard.snapshots is not None and (tmp_path / "snapshots/step_00000006/manifest.json").exists()


def test_callback_refuses_what_the_trainer_owns(tmp_path) -> None:
    with pytest.raises(TypeError, match="data= is not taken under the Trainer"):
        mscale.MscaleCallback(job_id="x", data=[1, 2])
    with pytest.raises(TypeError, match="snapshots: expected"):
        mscale.MscaleCallback(job_id="x", snapshots=3.5)
