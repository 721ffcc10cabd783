"""The Trainer callback on a real tiny LlavaForConditionalGeneration (random weights, nothing
downloaded) trained for a few steps on CPU by the real Hugging Face Trainer."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, Trainer,  # noqa: E402
                          TrainingArguments)

import mscale  # noqa: E402
from mscale.findings import Reason  # noqa: E402
from mscale.hook.guard import Guard  # noqa: E402
from mscale.sim.inject import inject  # noqa: E402

IMAGE_TOKEN = 127
PATCHES = (16 // 4) ** 2



def tiny_llava() -> LlavaForConditionalGeneration:
    torch.manual_seed(0)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=16, patch_size=4, projection_dim=32)
    text = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, vocab_size=128, max_position_embeddings=64)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                      vision_feature_layer=-1, vision_feature_select_strategy="default")
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

    callback = mscale.MscaleCallback(job_id="llava", connect=False, plugins=[watch, Inject()])
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=2, learning_rate=1e-3,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Captions(), callbacks=[callback])
    trainer.train()
    guard = callback.guard
    assert isinstance(guard, Guard)
    assert [(m.mpu_id, m.name, m.path) for m in guard.mpus] == [
        ("001", "vision", "model.vision_tower"), ("002", "aligner", "model.multi_modal_projector"),
        ("003", "text", "model.language_model")]
    assert [s for s, _ in watch.ends] == [0, 1, 2, 3, 4, 5]
    assert all(loss is not None for _, loss in watch.ends[:3])
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert watch.ends[0][1] == pytest.approx(logged[0], rel=1e-4)  # the loss the Trainer saw
    assert injected["i"].hits and injected["i"].hits[0].step == 3
    caught = [f for f in watch.findings if f.reason in (Reason.CHECKSUM_FAILURE, Reason.NONFINITE_OUTPUT)
              and f.labels["mpu"] == "aligner"]
    assert caught and caught[0].labels["step"] == "3"
    assert all(m.forward_s > 0 and m.checksum_checks_total >= 6 for m in guard.mpus)
    # detached at the end of training: once the test's injector is off, the model is as it was
    injected["i"].remove()
    ours = [(n, fn) for n, m in model.named_modules() for fn in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())
            if getattr(fn, "__module__", "").startswith("mscale")]  # transformers keeps hooks of its own
    assert ours == []
