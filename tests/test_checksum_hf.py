"""The checks on real Hugging Face model code built offline from configs: the check work done
once under activation checkpointing (tiny LLaVA), and replay quiet on Idefics3, whose text
model gets a `DynamicCache` that the first forward fills."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import mscale  # noqa: E402
import mscale.hook.checks.checksum as checksum_mod  # noqa: E402
from mscale.findings import Reason  # noqa: E402
from support.tiny_hf import tiny_llava  # noqa: E402

FAIL = (Reason.CHECKSUM_FAILURE, Reason.NONFINITE_OUTPUT)


def _checks_per_step(checkpointing: bool) -> tuple[list[int], list[float], int]:
    model, make_batch = tiny_llava(0)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = mscale.attach(
        model, opt, job_id="ckpt", connect=False, cmsa=False, checksum=mscale.ChecksumConfig(full=True)
    )
    det = guard.checksum
    calls = {"n": 0}
    original = det._abft_sums

    def counting(*a, **k):
        calls["n"] += 1
        return original(*a, **k)

    det._abft_sums = counting
    runs = {"n": 0}  # forwards of the linears, recomputations included
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda *a: runs.__setitem__("n", runs["n"] + 1))
    per_step, losses = [], []
    for s in range(3):
        before = calls["n"]
        out = model(**make_batch(s, torch.Generator().manual_seed(s)))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        per_step.append(calls["n"] - before)
        losses.append(float(out.loss.detach()))
    assert not [f for f in guard.findings if f.reason in FAIL]
    return per_step, losses, runs["n"]


def test_checks_run_once_under_activation_checkpointing() -> None:
    plain, loss_plain, runs_plain = _checks_per_step(False)
    ckpt, loss_ckpt, runs_ckpt = _checks_per_step(True)
    assert runs_ckpt > runs_plain  # checkpointing really recomputes the layers in backward
    assert plain[0] > 0 and ckpt == plain  # and the recomputation checks nothing again
    assert loss_ckpt == pytest.approx(loss_plain, rel=1e-5)  # the same training


def _idefics3():
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    cfg = Idefics3Config(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        text_config=dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=128,
        ),
        scale_factor=2,
        image_token_id=100,
    )
    torch.manual_seed(0)
    return Idefics3ForConditionalGeneration(cfg)


def _idefics3_replay_failures() -> int:
    model = _idefics3()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mpus = {"vision": "model.vision_model", "text": "model.text_model"}  # (its names are not discovered)
    cfg = mscale.ChecksumConfig(replay_every=1)  # every MPU replayed every step
    guard = mscale.attach(model, opt, job_id="idefics3", connect=False, cmsa=False, mpus=mpus, checksum=cfg)
    caches = []
    model.model.text_model.register_forward_pre_hook(
        lambda mod, a, k: caches.append(type(k.get("cache")).__name__), with_kwargs=True
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 99, (2, 12), generator=g)
        ids[:, 1:5] = 100  # 4 image tokens per image: (32 / 8)^2 patches / scale_factor^2
        out = model(input_ids=ids, pixel_values=torch.randn(2, 1, 3, 32, 32, generator=g), labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    assert "DynamicCache" in caches  # the case in point: a cache into the text model
    return sum(f.reason in FAIL and f.labels.get("method") == "replay" for f in guard.findings)


def test_replay_with_a_dynamic_cache_is_quiet_on_clean_idefics3(monkeypatch) -> None:
    assert _idefics3_replay_failures() == 0  # the replay got a fresh copy of the cache
    # without the fresh copies, the replay runs against the cache the first forward filled
    monkeypatch.setattr(checksum_mod, "fresh_copies", lambda args, kwargs: {})
    assert _idefics3_replay_failures() > 0


def test_a_corrupted_conv1d_output_in_a_tiny_gpt2_is_caught() -> None:
    """GPT-2's linears are Hugging Face `Conv1D` (y = x W + b, W stored (in, out)): checked
    through the registration (mscale.hook.checks.linears), clean steps pass, a corrupted output fails
    and its finding names the layer by its path in the model (the campaign's right-layer blame)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = mscale.ChecksumConfig(full=True, replay_every=0)
    guard = mscale.attach(
        model, opt, job_id="gpt2", connect=False, cmsa=False, mpus={"text": "transformer"}, checksum=cfg
    )
    conv = [m for m in model.modules() if isinstance(m, Conv1D)]
    assert len(conv) == 8 and not any(isinstance(m, torch.nn.Linear) for m in model.transformer.modules())
    checked = []
    original = guard.checksum._abft_sums
    guard.checksum._abft_sums = lambda mpu, st, module, *a: (checked.append(module), original(mpu, st, module, *a))
    on = {"fault": False}

    def fault(module, args, out):
        if on["fault"]:
            out = out.clone()
            out.view(-1)[5] = out.view(-1)[5] * 64.0 + 3.0
            return out
        return None

    conv[3].register_forward_hook(fault, prepend=True)  # in front of the checks: what the GEMM returned
    g = torch.Generator().manual_seed(0)
    for step in range(4):
        on["fault"] = step == 3
        ids = torch.randint(0, 64, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        failed = [f for f in guard.findings if f.reason in FAIL]
        assert bool(failed) == (step == 3), step
    assert {id(m) for m in checked} == {id(m) for m in conv}
    name = next(n for n, m in model.transformer.named_modules() if m is conv[3])  # h.0.mlp.c_proj
    assert failed[0].labels["method"] == "abft" and f"layer {name} " in failed[0].message
    assert failed[0].labels["layer"] == f"transformer.{name}"  # the model's name of the layer blamed


def test_on_a_tiny_llava_the_replays_ceiling_catches_a_towers_output_fault_the_bank_cannot_pay() -> None:
    """The guard's own work takes more than the 1% budget of a tiny LLaVA's step, so the replay
    bank is paid nothing; the ceiling (6 steps here, 400 by default) still replays the vision
    tower, and noise on its output after its last linear (the test's own forward hook, fresh
    noise each call as a faulty GPU would draw) is caught by a replay within the ceiling, with
    L1 two steps later."""
    model, make_batch = tiny_llava(0)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = mscale.ChecksumConfig(replay_max_gap_steps=6)
    guard = mscale.attach(model, opt, job_id="ceiling", connect=False, checksum=cfg)
    tower = guard.mpu("vision").module
    noise = torch.Generator().manual_seed(7)
    faulty = {"on": False}

    def corrupt(module, args, out):
        if faulty["on"]:
            h = out.last_hidden_state
            h.add_(0.05 * h.detach().abs().mean() * torch.randn(h.shape, generator=noise))

    tower.register_forward_hook(corrupt)

    def step(s: int) -> None:
        model(**make_batch(s, torch.Generator().manual_seed(s))).loss.backward()
        opt.step()
        opt.zero_grad()

    for s in range(4):
        step(s)
    assert guard.checksum.schedule.deposit_s == 0.0  # nothing left of the budget for the bank
    assert not [f for f in guard.findings if f.reason in FAIL]
    faulty["on"] = True
    first: dict = {}  # reason -> the faulty step (from 1) it first came in
    for k in range(1, 6 + 3 + 1):
        step(3 + k)
        for f in guard.findings:
            if f.labels.get("mpu") == "vision":
                first.setdefault(f.reason, k)
    replays = [f for f in guard.findings if f.reason is Reason.CHECKSUM_FAILURE]
    assert replays and all(f.labels["method"] == "replay" and f.labels["mpu"] == "vision" for f in replays)
    assert first[Reason.CHECKSUM_FAILURE] <= 6, first
    assert first[Reason.CHECKSUM_L1_TRIGGER] == first[Reason.CHECKSUM_FAILURE] + 2, first
