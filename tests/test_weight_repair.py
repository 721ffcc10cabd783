"""A weight corrupted between steps (`w.view(-1)[k] *= 1024` under no_grad, by the test's own
code after optimizer.step()) is found by its fingerprint before the next forward, attributed
to its MPU and tensor, and repaired from the newest in-memory snapshot: the repaired run ends
bitwise equal to the fault-free run. On the tiny multimodal model (the demo's loop), on a
tiny Hugging Face LLaVA in a plain loop and under the Trainer."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import structlog
import torch

import mscale
from mscale.demo.scenario import RunConfig, run
from mscale.findings import Finding
from mscale.healing.settings import HealingSection
from mscale.hook.checks.weights import Fingerprint
from mscale.hook.core.guard import Guard

K = 5  # the element multiplied by 1024
EVERY_WEIGHT = HealingSection(weight_groups=1)  # these tests are of the repair, in the next step


@pytest.fixture(autouse=True)
def _quiet():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    yield
    structlog.reset_defaults()


def corrupt(weight: torch.Tensor) -> None:
    with torch.no_grad():
        weight.view(-1)[K] *= 1024


def after_the_copy(guard) -> None:
    """Wait until the newest snapshot's copy landed (it runs beside the next step), so a weight
    hit now is not in it: the in-place repair. A hit while the copy is in flight is
    test_a_weight_hit_while_the_snapshot_copies_is_repaired_from_the_snapshot_before."""
    for p in guard.plugins:
        engine = getattr(p, "snapshot_engine", None)
        if engine is not None:
            engine.wait_copy()


def equal_states(a: torch.nn.Module, b: torch.nn.Module) -> list[str]:
    """Names of the tensors in which two models' state_dicts differ (bitwise)."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return [k for k in sa if not torch.equal(sa[k], sb[k])]


def of(findings: list[Finding], reason: str, **labels: str) -> list[Finding]:
    return [f for f in findings if f.reason.value == reason and all(f.labels.get(k) == v for k, v in labels.items())]


# --- fingerprints ---------------------------------------------------------------------------


def test_fingerprint_sees_every_single_element_change_and_nothing_else() -> None:
    torch.manual_seed(0)
    big = torch.randn(1100, 1000)  # over BATCH_MAX: fingerprinted on its own
    small = [torch.randn(7, 5), torch.randn(3).to(torch.bfloat16), torch.randn(4, 4)]
    fp = Fingerprint([*small, big])
    ref = fp.compute()
    assert torch.equal(fp.compute(), ref)  # deterministic
    with torch.no_grad():
        for t, i in ((small[0], 3), (small[1], 1), (big, 123_456), (small[2], 0)):
            bits = t.view(-1)[i : i + 1].view(torch.int32 if t.element_size() == 4 else torch.int16)
            for flip in (1, 1 << (8 * t.element_size() - 1)):  # lowest mantissa bit, sign bit
                bits ^= flip
                now = fp.compute()
                assert (now != ref).nonzero().flatten().tolist() == [
                    next(j for j, u in enumerate(fp.tensors) if u is t)
                ]
                bits ^= flip
                assert torch.equal(fp.compute(), ref)


# --- the tiny multimodal model (the demo's loop, a loader rewound in place) ------------------


def _tinymm(memory_every: int, *, at: int | None, healing: HealingSection | None = None, steps: int = 28):
    done: list[int] = []

    def between_steps(r) -> None:
        if at is not None and r.guard.current_step == at and not done:
            done.append(at)
            after_the_copy(r.guard)
            corrupt(r.model.vision_tower.layers[0].linear1.weight)

    cfg = RunConfig(steps=steps, memory_every=memory_every, before_step=between_steps)
    # every trained weight every step: these tests are of the repair (the rotation's bound: below)
    cfg.healing = dataclasses.replace(healing or cfg.healing, weight_groups=1)
    return run(cfg)


@pytest.mark.parametrize(
    ("memory_every", "repair", "steps_run"),
    [(1, "in_place", 28), (5, "rollback", 28 + 3)],  # 5: back to step 20, steps 21-23 again
)
def test_tinymm_weight_corruption_found_in_the_next_step_and_repaired_bitwise(memory_every, repair, steps_run) -> None:
    clean = _tinymm(memory_every, at=None)
    hit = _tinymm(memory_every, at=23)
    (f,) = of(hit.findings, "weight_corruption")
    assert f.labels["step"] == "23" and f.labels["mpu"] == "vision" and f.labels["mpu_id"] == "001"
    assert f.labels["tensor"] == "vision_tower.layers.0.linear1.weight" and f.severity.value == "critical"
    (fixed,) = of(hit.findings, "heal_action", action="restore_weights", result="applied")
    assert fixed.labels["repair"] == repair and fixed.labels["step"] == "23"
    assert hit.steps == 28 and hit.steps_run == steps_run
    assert not of(clean.findings, "weight_corruption")
    assert equal_states(clean.guard.model, hit.guard.model) == []


def test_tinymm_repair_that_rolls_back_into_cmsas_cold_start_is_still_bitwise() -> None:
    """Corrupted before step 8, the newest snapshot is of step 5: the re-run steps 6-8 lie in
    CMSA's 10-step cold start, which counts steps (not calls), so they clip as they did."""
    clean = _tinymm(5, at=None, steps=14)
    hit = _tinymm(5, at=8, steps=14)
    (fixed,) = of(hit.findings, "heal_action", action="restore_weights", result="applied")
    assert fixed.labels["repair"] == "rollback" and hit.steps_run == 14 + 3
    assert equal_states(clean.guard.model, hit.guard.model) == []


@pytest.mark.slow  # two runs
def test_tinymm_weight_corruption_without_healing_is_reported_once_and_stays() -> None:
    """The control: the same fault with the healing engine off is found (once) and not
    repaired, and the run ends elsewhere, so the bitwise test above can fail."""
    clean = _tinymm(5, at=None)
    hit = _tinymm(5, at=23, healing=HealingSection(enabled=False))
    assert [f.labels["step"] for f in of(hit.findings, "weight_corruption")] == ["23"]
    assert not of(hit.findings, "heal_action", result="applied")
    assert "vision_tower.layers.0.linear1.weight" in equal_states(clean.guard.model, hit.guard.model)


def test_frozen_weight_corrupted_between_steps_is_found_and_restored() -> None:
    """A frozen tower (requires_grad off, no optimizer touches it) is fingerprinted once and
    checked every step; its corruption is restored from the snapshot."""
    torch.manual_seed(0)
    from mscale.hook.fuse.fuse import FusePlugin
    from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal
    from mscale.snapshot.data import ResumableLoader
    from mscale.snapshot.engine import SnapshotEngine

    model = TinyMultimodal(TinyConfig())
    frozen = model.multi_modal_projector
    for p in frozen.parameters():
        p.requires_grad_(False)
    before = {k: v.clone() for k, v in frozen.state_dict().items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    data = ResumableLoader(SyntheticCaptions(TinyConfig(), size=256, seed=0), batch_size=8, seed=0)
    guard = Guard(model, opt, job_id="frozen", connect=False)
    findings: list[Finding] = []

    class Keep:
        def on_finding(self, f: Finding) -> None:
            findings.append(f)

    guard.add_plugin(Keep())
    fuse = FusePlugin(config=HealingSection(frozen_weights_every=1, weight_groups=1))
    engine = SnapshotEngine(model, opt, mpus={m.name: (m.mpu_id, m.module) for m in guard.mpus}, data=data)
    fuse.snapshot_engine = engine
    engine.snapshot(step=-1)
    guard.add_plugin(fuse)
    try:
        while guard.current_step < 8:
            if guard.current_step == 6 and not of(findings, "weight_corruption"):
                corrupt(frozen.linear_1.weight)
            b = data.next_batch()
            opt.zero_grad()
            model(b["images"], b["tokens"])["loss"].backward()
            opt.step()
    finally:
        engine.close()
        guard.detach()
    (f,) = of(findings, "weight_corruption")
    assert f.labels["step"] == "6" and f.labels["weights"] == "frozen" and f.labels["mpu"] == "aligner"
    assert of(findings, "heal_action", action="restore_weights", result="applied")
    assert all(torch.equal(before[k], v) for k, v in frozen.state_dict().items())


# --- a tiny Hugging Face LLaVA ------------------------------------------------------------


FC1 = "model.vision_tower.encoder.layers.0.mlp.fc1.weight"


def _llava_loop(*, at: int | None, memory_every: int, tensor: str = FC1, steps: int = 16, qwen: bool = False):
    """A plain loop whose batch is a function of the guard's step, so a rollback re-draws the
    same batches (the loop's own data position is the step). qwen: the tiny Qwen2-VL instead."""
    from support.tiny_hf import guarded

    model, make_batch, opt, guard, findings = guarded(
        "llava-weights", healing=EVERY_WEIGHT, memory_every=memory_every, qwen=qwen
    )
    assert isinstance(guard, Guard)
    weight = dict(model.named_parameters())[tensor]
    done = False
    try:
        while guard.current_step < steps:
            if guard.current_step == at and not done:
                done = True
                after_the_copy(guard)
                corrupt(weight)
            batch = make_batch(guard.current_step, torch.Generator().manual_seed(guard.current_step))
            opt.zero_grad()
            model(**batch).loss.backward()
            opt.step()
    finally:
        guard.detach()
    return model, findings


@pytest.mark.slow  # two runs of the LLaVA
@pytest.mark.parametrize(
    ("memory_every", "tensor", "mpu", "repair"),
    [(1, FC1, "vision", "in_place"), (4, "lm_head.weight", None, "rollback")],  # lm_head: outside every MPU
)
def test_llava_weight_corruption_repaired_bitwise_in_a_plain_loop(memory_every, tensor, mpu, repair) -> None:
    clean, _ = _llava_loop(at=None, memory_every=memory_every)
    hit, findings = _llava_loop(at=10, memory_every=memory_every, tensor=tensor)
    (f,) = of(findings, "weight_corruption")
    assert f.labels["step"] == "10" and f.labels.get("mpu") == mpu and f.labels["tensor"] == tensor
    (fixed,) = of(findings, "heal_action", action="restore_weights", result="applied")
    assert fixed.labels["repair"] == repair
    assert equal_states(clean, hit) == []


@pytest.mark.slow  # two runs of the Qwen2-VL
def test_qwen2vl_weight_corruption_repaired_bitwise_in_a_plain_loop() -> None:
    tensor = "model.visual.blocks.0.attn.qkv.weight"
    clean, _ = _llava_loop(at=None, memory_every=4, tensor=tensor, qwen=True)
    hit, findings = _llava_loop(at=10, memory_every=4, tensor=tensor, qwen=True)
    (f,) = of(findings, "weight_corruption")
    assert f.labels["step"] == "10" and f.labels["mpu"] == "vision" and f.labels["tensor"] == tensor
    assert of(findings, "heal_action", action="restore_weights", result="applied")
    assert equal_states(clean, hit) == []


def _trainer(tmp_path, model_name: str, *, at: int | None, memory_every: int = 1):
    """The real Trainer on the tiny LLaVA or the tiny multimodal model (whose forward takes
    images= and tokens= and returns a dict with the loss); the test's callback corrupts a
    vision weight after the optimizer step of step `at`."""
    from transformers import Trainer, TrainerCallback

    from support.hf_trainer import cpu_args

    if model_name == "llava":
        from support.tiny_hf import tiny_llava

        model, make_batch = tiny_llava(seed=0)
        rows = [
            {k: v[i] for k, v in make_batch(s, torch.Generator().manual_seed(s)).items()}
            for s in range(8)
            for i in range(4)
        ]
        weight = model.model.vision_tower.encoder.layers[0].mlp.fc1.weight
    else:
        from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal

        torch.manual_seed(0)
        model = TinyMultimodal(TinyConfig())
        data = SyntheticCaptions(TinyConfig(), size=32)
        rows = [{"images": data[i]["images"], "tokens": data[i]["tokens"]} for i in range(32)]
        weight = model.vision_tower.layers[0].linear1.weight
    findings: list[Finding] = []

    class Keep:
        def on_finding(self, f: Finding) -> None:
            findings.append(f)

    class CorruptAfterStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # after optimizer.step()
            if state.global_step == at:
                after_the_copy(callback.guard)
                corrupt(weight)
            return control

    callback = mscale.MscaleCallback(
        job_id=f"{model_name}-trainer-weights",
        connect=False,
        plugins=[Keep()],
        snapshots=mscale.SnapshotConfig(memory_every=memory_every),
        healing=EVERY_WEIGHT,
    )
    args = cpu_args(tmp_path, 8, 4)
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback, CorruptAfterStep()])
    trainer.train()
    return model, findings


@pytest.mark.slow  # two runs
@pytest.mark.parametrize("model_name", ["llava", "tinymm"])
def test_weight_corruption_repaired_bitwise_under_the_trainer(tmp_path, model_name) -> None:
    clean, _ = _trainer(tmp_path / "clean", model_name, at=None)
    hit, findings = _trainer(tmp_path / "hit", model_name, at=5)
    (f,) = of(findings, "weight_corruption")
    assert f.labels["step"] == "5" and f.labels["mpu"] == "vision"
    (fixed,) = of(findings, "heal_action", action="restore_weights", result="applied")
    assert fixed.labels["repair"] == "in_place"
    assert equal_states(clean, hit) == []


@pytest.mark.slow  # two runs
def test_under_the_trainer_an_older_snapshot_rolls_back_and_the_corruption_is_gone(tmp_path) -> None:
    """memory_every=4, corrupted after the Trainer's 6th step (the guard's step 5): the newest
    snapshot is of step 4 and the Trainer's loader cannot rewind, so the job rolls back to it
    and goes on (step 5 undone, not re-run: not bitwise), and the
    x1024 element is gone: it ends near the clean run's value, not 1024 times it."""
    clean, _ = _trainer(tmp_path / "clean", "llava", at=None, memory_every=4)
    hit, findings = _trainer(tmp_path / "hit", "llava", at=6, memory_every=4)
    (fixed,) = of(findings, "heal_action", action="restore_weights", result="applied")
    assert fixed.labels["repair"] == "rollback"
    assert [f.labels["step"] for f in of(findings, "rollback")] == ["4"]
    w = "model.vision_tower.encoder.layers.0.mlp.fc1.weight"
    a, b = dict(clean.named_parameters())[w].view(-1)[K].item(), dict(hit.named_parameters())[w].view(-1)[K].item()
    assert abs(b - a) < 0.1 * abs(a) + 0.05, (a, b)


def test_a_guard_without_its_optimizer_sees_training_as_no_corruption() -> None:
    """Weights requiring a gradient are re-fingerprinted at every step end, whoever updates
    them: a guard attached without the optimizer finds nothing in a clean run."""
    from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal

    torch.manual_seed(0)
    model = TinyMultimodal(TinyConfig())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = mscale.attach(model, None, job_id="no-optimizer", connect=False, snapshots=True)
    data = SyntheticCaptions(TinyConfig(), size=64)
    try:
        for i in range(6):
            b = torch.utils.data.default_collate([data[i * 4 + j] for j in range(4)])
            opt.zero_grad()
            loss = model(b["images"], b["tokens"])["loss"]
            loss.backward()
            opt.step()
            guard.step(loss)
    finally:
        guard.detach()
    assert guard.current_step == 6 and not of(list(guard.findings), "weight_corruption")


def test_chaos_loss_spike_keeps_a_hugging_face_output_type() -> None:
    """The chaos plugin's loss faults on a model returning a transformers ModelOutput: the loss
    is multiplied in place and `model(**batch).loss` still works (a plain dict broke it)."""
    from mscale.sim.chaos_job import ChaosPlugin
    from support.tiny_hf import tiny_llava

    model, make_batch = tiny_llava(seed=0)
    chaos = ChaosPlugin()
    guard = Guard(model, None, job_id="chaos-hf", connect=False, plugins=[chaos])
    try:
        batch = make_batch(0, torch.Generator().manual_seed(0))
        clean = model(**batch).loss.item()
        guard.step()
        chaos.inject("loss_spike", factor=25.0)
        out = model(**batch)
        assert type(out).__name__ == "LlavaCausalLMOutputWithPast"
        assert out.loss.item() == pytest.approx(25 * clean, rel=1e-5) and out["loss"] is out.loss
    finally:
        guard.detach()


def test_frozen_weights_are_checked_every_k_steps_and_reported_once() -> None:
    """frozen_every=3: a frozen weight changed before step 4 is found at step 6 (the next
    check), once; the trained ones are checked at every step."""
    from mscale.hook.checks.weights import WeightWatch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    guard = Guard(model, None, job_id="frozen-every", connect=False, mpus={"vision": model[0], "text": model[1]})
    found: list[Finding] = []
    watch = WeightWatch(guard, frozen_every=3, emit=found.append)
    try:
        for step in range(10):
            if step == 4:
                corrupt(model[0].weight)
            if step == 8:
                corrupt(model[1].weight)
            watch.check(step)
            watch.settle()
    finally:
        guard.detach()
    assert [(f.labels["step"], f.labels["weights"], f.labels["mpu"]) for f in found] == [
        ("6", "frozen", "vision"),
        ("8", "trained", "text"),
    ]


def test_fingerprint_of_a_non_contiguous_tensor_follows_its_updates() -> None:
    base = torch.randn(6, 5)
    t = base.t()  # non-contiguous: its flat reshape is a copy
    fp = Fingerprint([t, torch.randn(3)])
    ref = fp.compute()
    with torch.no_grad():
        t[1, 2] *= 1024
    assert (fp.compute() != ref).nonzero().flatten().tolist() == [0]


def test_fingerprint_passes_are_bounded_and_equal_to_per_tensor_sums(monkeypatch) -> None:
    """Small tensors share fused passes of at most BATCH_MAX words (the pass's int64 copy
    stays bounded for a large model); the result is each tensor's own sum of 64-bit words
    (the documented definition, computed here from its bytes), whatever the split."""
    import mscale.hook.checks.weights as weights

    monkeypatch.setattr(weights, "BATCH_MAX", 50)
    odd = torch.randn(41)[1:]  # not 8-byte aligned: fingerprinted from a copy
    ts = [torch.randn(7, 5), torch.randn(30), torch.randn(20), torch.randn(3).bfloat16(), torch.randn(100), odd]
    fp = weights.Fingerprint(ts)
    got = fp.compute()
    assert all(sum(ts[i].numel() for i in idx) <= 100 or len(idx) == 1 for idx, _, _ in fp._plan)

    def word_sum(t: torch.Tensor) -> int:
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        raw += bytes(-len(raw) % 8)
        total = sum(int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)) % (1 << 64)
        return total - (1 << 64) if total >= 1 << 63 else total

    assert got.tolist() == [word_sum(t) for t in ts]


def test_a_weight_hit_while_the_snapshot_copies_is_repaired_from_the_snapshot_before() -> None:
    """The snapshot of step 22 copies the weights beside step 23; a weight hit before that copy
    landed is in it. The repair finds the restored weights differ from their fingerprints,
    restores the snapshot of step 21 instead and rolls back to it: still bitwise."""
    import threading

    clean = _tinymm(1, at=None)  # weight groups do not change a clean run
    gate = threading.Event()

    def hold_the_copy_then_corrupt(r) -> None:
        if r.guard.current_step == 22:
            # a job queued first on the copier's background thread holds step 22's copy behind it
            r.snapshots.copier._background.submit(gate.wait, 60)
        elif r.guard.current_step == 23 and not gate.is_set():
            corrupt(r.model.vision_tower.layers[0].linear1.weight)
            gate.set()

    hit = run(RunConfig(steps=28, memory_every=1, before_step=hold_the_copy_then_corrupt, healing=EVERY_WEIGHT))
    assert gate.is_set()
    (f,) = of(hit.findings, "weight_corruption")
    assert f.labels["step"] == "23"
    (fixed,) = of(hit.findings, "heal_action", action="restore_weights", result="applied")
    assert fixed.labels["repair"] == "rollback"
    assert hit.steps == 28 and hit.steps_run == 28 + 2  # back to step 21: steps 22-23 again
    assert equal_states(clean.guard.model, hit.guard.model) == []
