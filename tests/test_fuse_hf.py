"""The fuse on real Hugging Face model code: tiny LlavaForConditionalGeneration (CLIP tower with a
fixed input size, projector, Llama) and tiny Qwen2VLForConditionalGeneration (dynamic-resolution
tower with its merger), random weights, built offline (tests/support/tiny_hf.py), trained on CPU
with the one-line protection. Faults are the test's own: a hook on a linear layer inside the
vision tower that corrupts its output (as a faulty GEMM would), seen by the guard's checks."""

from __future__ import annotations

import logging
import statistics

import pytest
import structlog
import torch

pytest.importorskip("transformers")

import mscale  # noqa: E402
from mscale.findings import Reason  # noqa: E402
from mscale.hook.fuse.degrade import family, reduction_for  # noqa: E402
from support.fuse_runs import fuse_decision  # noqa: E402
from support.tiny_hf import tiny_llava, tiny_qwen2vl  # noqa: E402

# the tiny LLaVA at 32x32 (an 8x8 patch grid): its 16x16 default (4x4) is below what L2 shrinks
BUILDERS = {"llava": lambda seed: tiny_llava(seed, 32), "qwen2vl": tiny_qwen2vl}


@pytest.fixture(autouse=True)
def quiet_logs():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    yield
    structlog.reset_defaults()


def tower(model):
    return getattr(model.model, "vision_tower", None) or model.model.visual


class Watch:
    def __init__(self) -> None:
        self.findings, self.reports = [], []

    def on_finding(self, f) -> None:
        self.findings.append(f)

    def on_report(self, report) -> None:  # read after every plugin added its part, as the link sends it
        self.reports.append(report)

    def heal(self, action, result="applied"):
        return [
            f
            for f in self.findings
            if f.reason is Reason.HEAL_ACTION and f.labels.get("action") == action and f.labels["result"] == result
        ]

    def states(self, mpu_id="001"):
        return [
            f.labels["state"] for f in self.findings if f.reason is Reason.FUSE_STATE and f.labels["mpu_id"] == mpu_id
        ]


class Fault:
    """Scales one element of a vision linear layer's output while on (registered after the guard,
    in front of its checks: what the checks see is what the GEMM produced)."""

    def __init__(self, model) -> None:
        self.on = False
        linear = next(m for m in tower(model).modules() if isinstance(m, torch.nn.Linear))
        self.handle = linear.register_forward_hook(self._hit, prepend=True)

    def _hit(self, module, args, out):
        if self.on:
            out = out.clone()
            out.view(-1)[0] = out.view(-1)[0] * 64.0 + 3.0
            return out
        return None


@pytest.mark.parametrize("name", ["llava", "qwen2vl"])
def test_l2_reduction_keeps_every_shape_and_undo_restores_the_forward(name):
    model, make_batch = BUILDERS[name](0)
    batch = make_batch(0, torch.Generator().manual_seed(0))
    ref = model(**batch)
    vision = tower(model)
    assert family(vision) == {"llava": "vit", "qwen2vl": "merge"}[name]
    assert family(model.model.language_model) is None  # no reduction for a text model
    seen = []
    embed = vision.embeddings if name == "llava" else vision.patch_embed
    h = embed.register_forward_pre_hook(lambda mod, args: seen.append(tuple(args[0].shape)))
    red = reduction_for(vision, 0.5)
    out = model(**batch)
    assert red is not None and red.calls == 1 and red.failures == []
    assert type(out) is type(ref) and out.logits.shape == ref.logits.shape and torch.isfinite(out.loss)
    assert not torch.equal(out.logits, ref.logits)  # the tower really ran reduced
    out.loss.backward()  # gradients flow through the resampling
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in embed.parameters())
    red.undo()
    assert "forward" not in vision.__dict__ and torch.equal(model(**batch).logits, ref.logits)
    h.remove()
    if name == "llava":  # 32x32 -> 16x16 pixels, then back
        assert [s[-2:] for s in seen] == [(16, 16), (32, 32)]
    else:  # a quarter of the patches (8x8 -> 4x4 grid of 2x2 patches, 4 images)
        assert [s[0] for s in seen] == [64, 256]


def train(name, *, fault_steps=(), steps, trainer=False, plugins=()):
    model, make_batch = BUILDERS[name](0)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    watch = Watch()
    guard = mscale.attach(model, opt, job_id=name, snapshots=True, connect=False, plugins=[watch, *plugins])
    fault = Fault(model)
    # what the tower's patch embedding receives, per forward: pixels per side (CLIP), patches (Qwen2-VL)
    vision = tower(model)
    embed = vision.embeddings if hasattr(vision, "embeddings") else vision.patch_embed
    guard.embedded = []
    # (the training forwards, not the checksum's replays: an incident replays the tower each step)
    embed.register_forward_pre_hook(
        lambda mod, args: (
            None
            if guard.checksum.replaying
            else guard.embedded.append((guard.current_step, args[0].shape[-1 if name == "llava" else 0]))
        )
    )
    shapes = {n: p.shape for n, p in model.named_parameters()}
    task, types, reported = [], set(), []
    guard.returned = []  # per step: the loss the model returned, and its task loss where L3 set one apart
    for s in range(steps):
        fault.on = s in fault_steps
        out = model(**make_batch(s, torch.Generator().manual_seed(s)))
        types.add(type(out).__name__)
        guard.returned.append((float(out.loss.detach()), float(out["task_loss"]) if "task_loss" in out else None))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        task.append(guard.summary().get("loss"))
        reported.append((s, guard._report().mpus["001"].distill_share))  # what the agent exports
    return model, guard, watch, task, types, shapes, reported


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llava", "qwen2vl"])
def test_persistent_vision_fault_escalates_l1_l2_l3_and_recovery_undoes_them(name):
    steps = 170
    model, guard, watch, task, types, shapes, reported = train(name, fault_steps=range(5, 60), steps=steps)
    assert guard.plugin_errors == 0  # nothing raised inside a fuse hook
    assert (
        len(task) == steps
        and types == {"llava": {"LlavaCausalLMOutputWithPast"}, "qwen2vl": {"MultimodalCausalLMOutputWithPast"}}[name]
    )
    assert watch.states()[:4] == ["suspect", "l1_swapped", "l2_degraded", "l3_distilling"]
    assert "recovered" in watch.states()
    (l2,) = watch.heal("l2_degrade")
    # the step that escalated to L2 re-ran the tower reduced: full, then reduced, input
    full, reduced = {"llava": (32, 16), "qwen2vl": (256, 64)}[name]
    l2_step = int(l2.labels["step"])
    assert [size for s, size in guard.embedded if s == l2_step] == [full, reduced]
    assert [size for s, size in guard.embedded if s == l2_step + 1] == [reduced]
    assert l2.labels["reduction"] == {"llava": "vit", "qwen2vl": "merge"}[name]
    (l3,) = watch.heal("l3_distill")
    assert "image-token positions" in l3.message or "image-token positions" in str(l3.labels)
    fuse = guard.fuse
    booked = fuse.states["l3_distill"].shares
    assert booked and sum(1 for *_, calibrating in booked if calibrating) == 1
    measured = [share for _, _, share, _, calibrating in booked if not calibrating]
    in_band = [0.15 <= s <= 0.30 for s in measured]
    # the weight comes from the step before, so a share can leave the band; most may not
    assert sum(in_band) >= 0.8 * len(measured) and 0.15 <= statistics.median(measured) <= 0.30, measured
    # the report to the agent carries the measured share while L3 holds, 0 before and after
    by_step = {s: share for s, _, share, _, _ in booked}
    last = max(by_step)  # the recovery step: booked, then the term removed before the report
    assert all(share == pytest.approx(by_step.get(s, 0.0)) for s, share in reported if s != last)
    assert reported[-1][1] == 0.0 and reported[0][1] == 0.0
    # the step report carries the loss returned and the task loss apart (mscale_job_loss, _task_loss)
    assert len(watch.reports) == len(guard.returned) == steps
    pairs = list(zip([(r.loss, r.task_loss) for r in watch.reports], guard.returned, strict=True))
    at_l3 = [(rep, ret) for rep, ret in pairs if ret[1] is not None]
    assert at_l3 and all(rep == pytest.approx(ret) and rep[0] > rep[1] for rep, ret in at_l3)
    assert all(rep[0] == rep[1] == pytest.approx(ret[0]) for rep, ret in pairs if ret[1] is None)
    # recovery undid L2 and L3: the tower's own forward, no term, the parameters as they were
    assert "forward" not in tower(model).__dict__
    assert not fuse.states["l2_degrade"].mpus and not fuse.states["l3_distill"].mpus
    assert {n: p.shape for n, p in model.named_parameters()} == shapes
    assert guard.mpu("vision").distill_share == 0.0


def test_a_reduced_forward_that_raises_is_undone_and_escalates_to_l3():
    """A tower that refuses the reduced size (here: the test's pre-hook on its embeddings raises
    for any image under 32x32): the step completes on the tower's own forward, the fuse books
    the failed L2 measure, undoes it and escalates to L3; no exception reaches the loop."""
    model, make_batch = tiny_llava(0, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = Watch()
    guard = mscale.attach(model, opt, job_id="refuse", snapshots=True, connect=False, plugins=[watch])

    def refuse(module, args):
        if args[0].shape[-1] < 32:
            raise ValueError("Input image size (16*16) doesn't match model (32*32).")

    tower(model).embeddings.register_forward_pre_hook(refuse)
    fault = Fault(model)
    for s in range(14):
        fault.on = s >= 2
        out = model(**make_batch(s, torch.Generator().manual_seed(s)))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    assert guard.plugin_errors == 0
    (failed,) = watch.heal("l2_degrade", "failed")
    assert "ValueError" in failed.message or "ValueError" in str(failed.labels)
    assert watch.heal("l3_distill")  # escalated
    assert guard.mpu("vision").fuse_level == "l3_distilling"
    (step, mpu_id, error) = guard.fuse.states["l2_degrade"].failed[0]
    assert mpu_id == "001" and "doesn't match" in error
    assert guard.fuse.states["l2_degrade"].mpus["001"][0] is None  # the reduction undone
    assert "forward" not in tower(model).__dict__


def test_l3_without_a_text_mpu_is_not_applied_and_says_why():
    model, make_batch = tiny_llava(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mpus = {"vision": "model.vision_tower", "aligner": "model.multi_modal_projector"}
    guard = mscale.attach(model, opt, job_id="no-text", snapshots=True, connect=False, mpus=mpus)
    out = model(**make_batch(0, torch.Generator().manual_seed(0)))
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    fuse = guard.fuse
    m = guard.mpu("vision")
    d = fuse_decision(fuse, m, "l3_distill", step=guard.current_step)
    assert fuse.run(d) == "failed"
    assert not fuse.states["l3_distill"].mpus and m.fuse_level != "l3_distilling"
    booked = [f for f in guard.findings if f.reason is Reason.HEAL_ACTION and f.labels.get("action") == "l3_distill"]
    assert "no text MPU" in booked[-1].message + str(booked[-1].labels)


@pytest.mark.slow
def test_trainer_path_escalates_and_recovers_on_tiny_llava(tmp_path):
    """The same persistent fault under the Hugging Face Trainer with the project's callback:
    L1 -> L2 -> L3 without an exception, to the last step, and recovery undoes L2 and L3."""
    from transformers import Trainer

    from support.hf_trainer import cpu_args

    model, make_batch = tiny_llava(0, 32)  # an 8x8 patch grid, which L2 halves

    class Items(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 4 * 200

        def __getitem__(self, i: int) -> dict:
            batch = make_batch(i // 4, torch.Generator().manual_seed(i // 4))
            return {k: v[i % 4] for k, v in batch.items()}

    watch = Watch()
    faults = {}

    class FaultFrom5To60:
        def on_attach(self, guard) -> None:  # after the guard's hooks: in front of its checks
            faults["f"] = Fault(guard.model)

        def on_step_begin(self, step, batch) -> None:
            faults["f"].on = 5 <= step < 60

    callback = mscale.MscaleCallback(job_id="trainer", connect=False, snapshots=True, plugins=[watch, FaultFrom5To60()])
    args = cpu_args(tmp_path, 130, 4, learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=10)
    trainer = Trainer(model=model, args=args, train_dataset=Items(), callbacks=[callback])
    trainer.train()
    guard = callback.guard
    assert trainer.state.global_step == 130 and guard.plugin_errors == 0
    assert watch.states()[:5] == ["suspect", "l1_swapped", "l2_degraded", "l3_distilling", "recovered"]
    assert watch.heal("l2_degrade")[0].labels["reduction"] == "vit"
    assert guard.fuse.states["l3_distill"].shares  # the term reached the Trainer's loss
    assert not guard.fuse.states["l2_degrade"].mpus and not guard.fuse.states["l3_distill"].mpus
    assert "forward" not in tower(model).__dict__


def test_l3_projects_a_student_narrower_than_the_text_model_and_drops_it_on_close():
    """A failing MPU whose output reaches the text model without a projector and is not
    text-wide: the term makes a projection at L3 entry, trains it at each step's end, and
    close() (recovery) removes it."""
    from mscale.hook.core.mpu import discover
    from mscale.hook.fuse.distill import Captured, Term

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = type("C", (), {"image_token_id": 9})()
            self.vision_tower = torch.nn.Linear(4, 16)
            self.language_model = torch.nn.Embedding(10, 32)

    model = Model()
    mpus = discover(model)
    term = Term(model, mpus, mpus[0])
    assert term.why_not() == "" and term.carrier is mpus[0] and term.width == 32
    ids = torch.tensor([[9, 9, 1, 2], [9, 9, 3, 4]])
    cap = Captured(input_ids=ids)
    cap.outputs["001"] = model.vision_tower(torch.randn(2, 2, 4))  # (B, 2 image rows, 16)
    cap.outputs["002"] = torch.randn(2, 4, 32)  # the text model's hidden states
    loss, why = term.loss(cap)
    assert why == "" and loss is not None and float(loss.detach()) > 0
    assert term.projection is not None and term.projection.in_features == 16
    before = term.projection.weight.detach().clone()
    loss.backward()
    assert model.vision_tower.weight.grad is not None  # the student is trained through it
    term.step()
    assert not torch.equal(before, term.projection.weight)  # the projection is trained too
    cap.input_ids = torch.tensor([[9, 1, 1, 2], [9, 9, 3, 4]])  # 3 placeholders for 4 rows
    assert term.loss(cap)[0] is None and "3 image-token positions for 4 student rows" in term.loss(cap)[1]
    term.close()
    assert term.projection is None


def test_l3_with_a_zero_band_adds_nothing_and_never_raises_into_the_loop():
    """distill_weight_min = max = 0 is a valid setting: the term's weight is 0 (it used to take
    log(0) inside the model's forward hook, which raised into the training loop)."""
    model, make_batch = tiny_llava(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = mscale.attach(model, opt, job_id="zero-band", snapshots=True, connect=False)
    guard.fuse.states["l3_distill"].band = (0.0, 0.0)
    fuse, m = guard.fuse, guard.mpu("vision")
    losses = []
    for s in range(4):
        if s == 1:
            d = fuse_decision(fuse, m, "l3_distill", step=s)
            assert fuse.run(d) == "applied"
        out = model(**make_batch(s, torch.Generator().manual_seed(s)))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append((float(out.loss.detach()), guard.summary().get("loss")))  # the total, the task loss
    assert all(total == pytest.approx(task) for total, task in losses[1:])  # the term weighs 0
    assert [share for _, _, share, _, _ in fuse.states["l3_distill"].shares] == [0.0, 0.0, 0.0]


def test_l2_never_shrinks_a_patch_grid_below_the_minimum():
    """The 16x16 tiny LLaVA's 4x4 grid at half size would be 2x2, too little of the image to learn
    from: no reduction, and why; an 8x8 grid halves to 4x4; a 12x12 one stops at 4x4 however small
    the scale; Qwen2-VL's 8x8 grid of 2x2 merge windows halves to 4x4."""
    from mscale.hook.fuse.degrade import MIN_GRID, why_none

    assert MIN_GRID == 4
    small, _ = tiny_llava(0)
    assert reduction_for(tower(small), 0.5) is None
    assert why_none(tower(small), 0.5) == "its 4x4 patch grid cannot shrink and keep 4x4"
    for image, scale, pixels in ((32, 0.5, 16), (48, 0.1, 16), (48, 0.75, 36)):
        model, make_batch = tiny_llava(0, image)
        seen: list[int] = []
        tower(model).embeddings.register_forward_pre_hook(lambda mod, args, seen=seen: seen.append(args[0].shape[-1]))
        assert why_none(tower(model), scale) == ""
        red = reduction_for(tower(model), scale)
        assert red is not None
        model(**make_batch(0, torch.Generator().manual_seed(0)))
        assert seen == [pixels]
        red.undo()
    # through the fuse: L2 on the 16x16 tower is applied (the raised clip), with no reduction, and says why
    opt = torch.optim.AdamW(small.parameters(), lr=1e-3)
    watch = Watch()
    guard = mscale.attach(small, opt, job_id="min-grid", snapshots=True, connect=False, plugins=[watch])
    vision = guard.mpu("vision")
    d = fuse_decision(guard.fuse, vision, "l2_degrade", step=0)
    assert guard.fuse.run(d) == "applied"
    (event,) = watch.heal("l2_degrade")
    assert event.labels["reduction"] == "none" and "its 4x4 patch grid cannot shrink and keep 4x4" in event.message
    assert "forward" not in tower(small).__dict__
    guard.detach()


def test_l2_on_an_mpu_without_a_reduction_says_so_and_changes_no_shape():
    model, make_batch = tiny_llava(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = Watch()
    guard = mscale.attach(model, opt, job_id="no-reduction", snapshots=True, connect=False, plugins=[watch])
    batch = make_batch(0, torch.Generator().manual_seed(0))
    ref = model(**batch).logits.shape
    fuse, text = guard.fuse, guard.mpu("text")
    d = fuse_decision(fuse, text, "l2_degrade", step=0)
    assert fuse.run(d) == "applied"
    (event,) = [f for f in watch.heal("l2_degrade") if f.labels["mpu_id"] == "003"]
    assert event.labels["reduction"] == "none" and "no shape-preserving reduction applies" in event.message
    assert "fallback" not in event.labels  # on the CPU: no fallback either (bf16 is opt-in)
    assert model(**batch).logits.shape == ref and "forward" not in text.module.__dict__


def test_l3_that_cannot_place_its_student_is_not_applied():
    """Without an image token id in the config (and the student not the text model's leading
    input) the student's positions are unknown: the term is tried on the last step, fails, and
    L3 is booked failed with the reason; the MPU keeps its level."""
    model, make_batch = tiny_llava(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = mscale.attach(model, opt, job_id="no-positions", snapshots=True, connect=False)
    out = model(**make_batch(0, torch.Generator().manual_seed(0)))
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    model.config.image_token_id = None  # the term reads the model's config when L3 starts
    fuse, m = guard.fuse, guard.mpu("vision")
    d = fuse_decision(fuse, m, "l3_distill", step=1)
    assert fuse.run(d) == "failed" and m.fuse_level == "healthy"
    booked = [f for f in guard.findings if f.reason is Reason.HEAL_ACTION and f.labels.get("action") == "l3_distill"]
    assert "positions in the text sequence are not known" in booked[-1].message


class NoProjector(torch.nn.Module):
    """A vision tower whose 16-wide output reaches a 32-wide text model with no projector MPU
    between them (L3 makes its own projection): images fill the placeholder tokens (id 9)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("C", (), {"image_token_id": 9})()
        self.vision_tower = torch.nn.Linear(4, 16)
        self.widen = torch.nn.Linear(16, 32)  # part of the model, not an MPU
        self.embed = torch.nn.Embedding(10, 32)
        self.language_model = torch.nn.Linear(32, 32)
        self.language_model.config = type("T", (), {"hidden_size": 32})()
        self.head = torch.nn.Linear(32, 10)

    def forward(self, input_ids, pixel_values, labels):
        h = self.embed(input_ids)
        image = self.widen(self.vision_tower(pixel_values)).reshape(-1, 32)
        h = h.masked_scatter((input_ids == 9).unsqueeze(-1).expand_as(h), image)
        logits = self.head(self.language_model(h))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 10), labels.reshape(-1))
        return {"loss": loss, "logits": logits}


def test_a_rollback_at_l3_restores_its_projection_and_recovery_removes_it():
    """L3's own projection (no projector downstream of the failing MPU) is held in the in-memory
    snapshots with its optimizer's state: a rollback while at L3 puts back the projection of the
    snapshot's step, not the one trained since; the re-run steps then repeat the first run."""
    torch.manual_seed(0)
    model = NoProjector()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = mscale.attach(model, opt, job_id="l3-projection", snapshots=True, connect=False)
    fuse, m = guard.fuse, guard.mpu("vision")
    engine = fuse.snapshot_engine
    engine.memory_every, engine.memory_keep = 2, 10
    state = fuse.states["l3_distill"]

    def batch(s):
        g = torch.Generator().manual_seed(s)
        ids = torch.cat([torch.full((4, 2), 9), torch.randint(0, 9, (4, 3), generator=g)], dim=1)
        return {"input_ids": ids, "pixel_values": torch.randn(4, 2, 4, generator=g), "labels": ids % 9}

    def step(s):
        out = model(**batch(s))
        out["loss"].backward()
        opt.step()
        opt.zero_grad()
        return float(out["loss"].detach())

    def rollback(to):  # what the rollback action does after the step
        assert engine.rollback(to) == to
        fuse.dispatch("weights_settled")
        guard.set_step(to + 1)

    step(0)
    d = fuse_decision(fuse, m, "l3_distill", step=1)
    assert fuse.run(d) == "applied"
    term = state.mpus[m.mpu_id].term
    assert term.carrier is m and term.projection is not None  # made at L3 entry
    made = {k: v.clone() for k, v in term.projection.state_dict().items()}
    losses = {s: step(s) for s in range(1, 5)}  # snapshots at steps 0 (before L3), 2 and 4
    assert engine.memory_steps[-1] == 4
    held = {k: v.clone() for k, v in term.projection.state_dict().items()}
    held_opt = {k: v.clone() for k, v in term._opt.state[term.projection.weight].items()}
    for s in (5, 6, 7):
        step(s)
    assert not torch.equal(term.projection.weight, held["weight"])  # trained since
    rollback(4)
    assert all(torch.equal(v, held[k]) for k, v in term.projection.state_dict().items())
    restored = term._opt.state[term.projection.weight]
    assert restored.keys() == held_opt.keys() and all(torch.equal(restored[k], held_opt[k]) for k in held_opt)
    # a snapshot from before L3's entry: the projection as it was made, a fresh optimizer
    rollback(0)
    assert all(torch.equal(v, made[k]) for k, v in term.projection.state_dict().items())
    assert not term._opt.state
    # steps 1-4 again on the same batches: the same losses as the first time, bit for bit
    assert [step(s) for s in range(1, 5)] == [losses[s] for s in range(1, 5)]
    # recovery removes the projection, and the snapshots hold nothing of L3 afterwards
    fuse.dispatch("undo", m)
    assert term.projection is None and state.state_dict() == {}
    guard.detach()
    assert "fuse_l3" not in engine.extra


def test_a_snapshot_without_an_optional_extra_still_restores():
    """Snapshots written before the fuse's L3 state was an extra (or by a job without the fuse)
    restore: an extra marked snapshot_optional gets None; any other missing extra is refused."""
    from mscale.snapshot.engine import SnapshotEngine, SnapshotError

    class Extra:
        def __init__(self, optional: bool) -> None:
            self.snapshot_optional, self.loaded = optional, []

        def state_dict(self) -> dict:
            return {"n": 1}

        def load_state_dict(self, state) -> None:
            self.loaded.append(state)

    model = torch.nn.Linear(4, 4)
    engine = SnapshotEngine(model, torch.optim.AdamW(model.parameters()))
    engine.snapshot(1)
    optional = Extra(True)
    engine.extra["later"] = optional
    assert engine.rollback(1) == 1 and optional.loaded == [None]
    engine.snapshot(2)
    assert engine.rollback(2) == 2 and optional.loaded == [None, {"n": 1}]
    engine.extra["required"] = Extra(False)
    with pytest.raises(SnapshotError, match="holds no state for 'required'"):
        engine.rollback(2)
    engine.close()
