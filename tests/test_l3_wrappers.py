"""L3 whatever holds the Hugging Face model and whatever tokens its tower fills: under Lightning
(the guard sees the LightningModule, the model is its `self.model`), and on a Video-LLaVA whose
video tower is mapped as an MPU (its features fill the video tokens, through the projector the
image tower shares). Real training on CPU with a persistent fault from the test's own hook on the
tower's first linear, escalated by the fuse L1 -> L2 -> L3; and where L3 cannot be applied, it is
said once, when the MPU first runs, with why."""

from __future__ import annotations

import logging

import pytest
import structlog
import torch
from structlog.testing import capture_logs

pytest.importorskip("transformers")
pytest.importorskip("lightning")

import lightning as L  # noqa: E402
import transformers as T  # noqa: E402

import mscale  # noqa: E402
from mscale.findings import Reason  # noqa: E402
from support.fuse_runs import fuse_decision  # noqa: E402
from support.tiny_hf import BATCH, VOCAB, Samples, _captions, _images, _patterns, tiny_llava  # noqa: E402

IMAGE, PATCH, FRAMES = 32, 8, 2  # 32x32: a 4x4 grid L2 can shrink to 2x2
IMAGE_TOKEN, VIDEO_TOKEN = 126, 127


@pytest.fixture(autouse=True)
def quiet_logs():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    yield
    structlog.reset_defaults()


class Watch:
    def __init__(self) -> None:
        self.findings: list = []

    def on_finding(self, f) -> None:
        self.findings.append(f)

    def heal(self, action: str) -> list:
        return [f for f in self.findings if f.reason is Reason.HEAL_ACTION and f.labels.get("action") == action]


def persistent_fault(tower: torch.nn.Module, on=lambda: True):
    """One element of the tower's first linear's output scaled, on every forward while `on()`
    (registered after the guard, in front of its checks: what they see is what the GEMM made)."""
    linear = next(m for m in tower.modules() if isinstance(m, torch.nn.Linear))

    def hit(module, args, out):
        if not on():
            return None
        out = out.clone()
        out.view(-1)[0] = out.view(-1)[0] * 64.0 + 3.0
        return out

    return linear.register_forward_hook(hit, prepend=True)


def assert_l3_applied(watch: Watch, guard, mpu: str, where: str) -> None:
    l3 = watch.heal("l3_distill")
    assert l3, [f.message for f in watch.heal("l2_degrade")]
    assert all(f.labels["result"] == "applied" for f in l3), [f.message for f in l3]
    assert where in l3[0].message, l3[0].message
    shares = guard.fuse.states["l3_distill"].shares
    assert shares and {mpu_id for _, mpu_id, *_ in shares} == {guard.mpu(mpu).mpu_id}  # the term reached the loss
    assert all(share > 0 for _, _, share, _, _ in shares)


class Captioner(L.LightningModule):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, **batch):
        return self.model(**batch)

    def training_step(self, batch, batch_idx):
        return self(**batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def test_l3_is_applied_under_lightning_with_bf16_mixed(tmp_path) -> None:
    """The guard holds the LightningModule; the placeholder id is in the LLaVA inside it. It used
    to fail L3 on every step ("no image token id in the model's config")."""
    model, make_batch = tiny_llava(0, IMAGE)
    watch = Watch()
    callback = mscale.lightning.MscaleCallback(job_id="pl-l3", snapshots=True, connect=False, plugins=[watch])

    class Fault(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            persistent_fault(model.model.vision_tower, on=lambda: callback.guard.current_step >= 2)

    torch.manual_seed(0)
    trainer = L.Trainer(
        max_steps=18,
        accumulate_grad_batches=2,
        precision="bf16-mixed",
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.callbacks += [callback, Fault()]
    loader = torch.utils.data.DataLoader(Samples(make_batch, 128), batch_size=BATCH, shuffle=False)
    trainer.fit(Captioner(model), loader)
    assert_l3_applied(watch, callback.guard, "vision", "image-token positions")
    assert callback.guard.fuse.states["l3_distill"].unavailable == {}


def tiny_video_llava(seed: int = 0):
    """Video-LLaVA: an image tower and a video tower (two CLIPs) behind one projector, a Llama;
    each sample holds an image ahead of a FRAMES-frame video of its class, then its caption."""
    torch.manual_seed(seed)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE)
    text = dict(
        model_type="llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=128,
    )
    cfg = T.VideoLlavaConfig(
        vision_config={**vision, "patch_size": PATCH},
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        video_token_index=VIDEO_TOKEN,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    model = T.VideoLlavaForConditionalGeneration(cfg)
    patterns, captions = _patterns(seed, IMAGE), _captions(seed)
    grid = (IMAGE // PATCH) ** 2
    image_tokens, video_tokens = grid, FRAMES * (grid + 1)  # the video keeps each frame's CLS row

    def make_batch(step: int, g: torch.Generator) -> dict:
        cls, pixels = _images(patterns, g)
        frames = patterns[cls].unsqueeze(1).expand(-1, FRAMES, -1, -1, -1)
        frames = frames + 0.1 * torch.randn(frames.shape, generator=g)
        ids = torch.cat(
            [
                torch.full((BATCH, image_tokens), IMAGE_TOKEN),
                torch.full((BATCH, video_tokens), VIDEO_TOKEN),
                captions[cls],
            ],
            dim=1,
        )
        labels = ids.masked_fill((ids == IMAGE_TOKEN) | (ids == VIDEO_TOKEN), -100)
        return {"input_ids": ids, "pixel_values": pixels, "pixel_values_videos": frames, "labels": labels}

    return model, make_batch


VIDEO_MPUS = {
    "vision": "model.image_tower",
    "video": "model.video_tower",
    "aligner": "model.multi_modal_projector",
    "text": "model.language_model",
}


def train(model, make_batch, steps: int, samples: int = BATCH, **attach) -> tuple:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    watch = Watch()
    guard = mscale.attach(model, opt, job_id="l3", snapshots=True, connect=False, plugins=[watch], **attach)
    fault = persistent_fault(model.model.video_tower, on=lambda: guard.current_step >= 2)
    for s in range(steps):
        batch = {k: v[:samples] for k, v in make_batch(s, torch.Generator().manual_seed(s)).items()}
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    fault.remove()
    return guard, watch


def test_l3_is_applied_to_a_video_llava_video_tower() -> None:
    """The video tower's features fill the video tokens, through the projector the image tower
    also runs through each step. L3 used to count image tokens for them and fail on every step
    ("N image-token positions for M student rows")."""
    model, make_batch = tiny_video_llava(0)
    guard, watch = train(model, make_batch, 16, mpus=VIDEO_MPUS)
    assert_l3_applied(watch, guard, "video", "video-token positions")
    assert guard.mpu("video").fuse_level == "l3_distilling"
    assert guard.fuse.states["l3_distill"].unavailable == {}
    guard.detach()


def test_l3_unavailable_for_an_mpu_is_said_once() -> None:
    """Where L3 cannot be applied to an MPU it is said once, with why: at attach what the layout
    rules out (no text MPU to take the teacher from), at the end of the MPU's first step what the
    batch does (a contrastive term over one sample), not again at later steps."""
    structlog.reset_defaults()  # warnings reach capture_logs (the quiet fixture drops them)
    model, make_batch = tiny_video_llava(0)
    no_text = {k: v for k, v in VIDEO_MPUS.items() if k != "text"}
    with capture_logs() as logs:
        guard, _ = train(model, make_batch, 3, mpus=no_text)
    said = [(e["mpu"], e["why"]) for e in logs if e["event"] == "l3_unavailable"]
    assert said == [(n, "no text MPU to take the teacher from") for n in no_text]
    guard.detach()
    model, make_batch = tiny_video_llava(0)
    with capture_logs() as logs:
        guard, _ = train(model, make_batch, 3, samples=1, mpus=VIDEO_MPUS)
    said = [(e["mpu"], e["why"]) for e in logs if e["event"] == "l3_unavailable"]
    why = "the contrastive term needs at least 2 samples in the batch"
    assert said == [(n, why) for n in ("vision", "video", "aligner")]
    assert guard.fuse.states["l3_distill"].unavailable == {
        guard.mpu(n).mpu_id: why for n in ("vision", "video", "aligner")
    }
    guard.detach()


def wrapped(kind: str, model: torch.nn.Module) -> torch.nn.Module:
    if kind == "lightning":
        return Captioner(model)
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(model)
    if kind == "accelerate":
        from accelerate import Accelerator

        return Accelerator(cpu=True).prepare_model(model)
    return model


@pytest.fixture
def accelerate_reset():
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # other tests in this process build their own Accelerator
    GradientState._reset_state()


@pytest.fixture(scope="module")
def one_rank_group():
    import torch.distributed as dist

    from support import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["lightning", "ddp", "fsdp2", "accelerate"])
def test_l3_finds_the_model_inside_each_wrapper(kind: str, one_rank_group, accelerate_reset) -> None:
    """Each wrapper the guard may be given (a one-rank gloo group for DDP and FSDP2): the term
    finds the LLaVA's image token and is built at L3 entry, and the next step's loss carries it."""
    model, make_batch = tiny_llava(0)
    outer = wrapped(kind, model)
    opt = torch.optim.AdamW(outer.parameters(), lr=1e-3)
    guard = mscale.attach(outer, opt, job_id=kind, snapshots=True, connect=False)
    for s in range(2):
        outer(**make_batch(s, torch.Generator().manual_seed(s))).loss.backward()
        opt.step()
        opt.zero_grad()
    fuse, m = guard.fuse, guard.mpu("vision")
    decision = fuse_decision(fuse, m, "l3_distill", step=1)
    assert fuse.run(decision) == "applied", [f.message for f in guard.findings][-3:]
    out = outer(**make_batch(2, torch.Generator().manual_seed(2)))
    assert float(out.loss) > float(out["task_loss"])
    assert fuse.states["l3_distill"].mpus[m.mpu_id].term.layout == "image-token positions"
    guard.detach()


@pytest.mark.slow
def test_l3_on_a_compiled_model_is_said_unavailable_once() -> None:
    """torch.compile (the eager backend: dynamo's graph, no code generation): the MPUs' outputs
    stay inside the graph, so no term can be read; said once per MPU at the first step's end."""
    structlog.reset_defaults()  # warnings reach capture_logs (the quiet fixture drops them)
    model, make_batch = tiny_llava(0)
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with capture_logs() as logs:
        guard = mscale.attach(compiled, opt, job_id="compiled", snapshots=True, connect=False)
        for s in range(3):
            compiled(**make_batch(s, torch.Generator().manual_seed(s))).loss.backward()
            opt.step()
            opt.zero_grad()
    said = [(e["mpu"], e["why"]) for e in logs if e["event"] == "l3_unavailable"]
    assert [mpu for mpu, _ in said] == ["vision", "aligner"]
    assert all("the model is compiled" in why for _, why in said)
    guard.detach()
