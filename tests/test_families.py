"""Every multimodal family built here as a tiny Hugging Face model from its config
(tests/support/tiny_hf.py, tiny_families.py): LLaVA, LLaVA-NeXT, Qwen2-VL, Idefics2, Idefics3,
SmolVLM, Blip2, InstructBLIP, PaliGemma, Gemma3, Mistral3, Aya Vision, InternVL and, with an audio
tower, Qwen2-Audio. For each: discovery finds its encoder (vision or audio tower), its aligner
(and the Q-Former) and its text model; 100 clean steps under the README's protection line make
no critical finding; a persistent fault the test's own hook puts in the encoder's last linear
is healed by the fuse (suspect, L1 swap, L2, L3, whose output carries the task loss apart) and
training goes on finite.

Beyond those, every family the installed transformers maps as image-text-to-text or multimodal
LM is built on the meta device from its default config and discovered
(`test_every_installed_multimodal_family_is_discovered_or_says_why`); the ones whose MPUs are not
found, or that do not build so, are listed in support/family_scope.py's GAPS with the reason, and
those with no vision or audio tower at all in its OUT_OF_SCOPE."""

from __future__ import annotations

import math

import pytest
import torch

import mscale
from mscale.findings import Reason, Severity
from support import tiny_families as tf
from support.family_scope import GAPS, OUT_OF_SCOPE
from support.fuse_runs import fuse_decision
from support.tiny_families import blip2, idefics3
from support.tiny_hf import tiny_llava, tiny_qwen2vl

CLEAN, FAULTY = 100, 12
FAMILIES = {
    "llava": (lambda: tiny_llava(seed=0), ["vision", "aligner", "text"]),
    "qwen2vl": (lambda: tiny_qwen2vl(seed=0, normalize=True), ["vision", "text"]),
    "idefics3": (lambda: idefics3(seed=0), ["vision", "aligner", "text"]),
    "smolvlm": (lambda: idefics3(seed=0, smol=True), ["vision", "aligner", "text"]),
    "blip2": (lambda: blip2(seed=0), ["vision", "resampler", "aligner", "text"]),
    "instructblip": (lambda: tf.instructblip(seed=0), ["vision", "resampler", "aligner", "text"]),
    "paligemma": (lambda: tf.paligemma(seed=0), ["vision", "aligner", "text"]),
    "gemma3": (lambda: tf.gemma3(seed=0), ["vision", "aligner", "text"]),
    "mistral3": (lambda: tf.mistral3(seed=0), ["vision", "aligner", "text"]),
    "aya_vision": (lambda: tf.aya_vision(seed=0), ["vision", "aligner", "text"]),
    "internvl": (lambda: tf.internvl(seed=0), ["vision", "aligner", "text"]),
    "llava_next": (lambda: tf.llava_next(seed=0), ["vision", "aligner", "text"]),
    "idefics2": (lambda: tf.idefics2(seed=0), ["vision", "aligner", "text"]),
    "qwen2_audio": (lambda: tf.qwen2_audio(seed=0), ["audio", "aligner", "text"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_is_discovered_trains_clean_and_a_vision_fault_is_healed(family: str) -> None:
    build, names = FAMILIES[family]
    model, make_batch = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = mscale.attach(model, opt, job_id=family, snapshots=True, connect=False)
    assert [m.name for m in guard.mpus] == names
    vision = guard.mpus[0]  # the encoder: the vision tower, or Qwen2-Audio's audio tower
    last = [m for m in vision.module.modules() if isinstance(m, torch.nn.Linear)][-1]
    faulty = {"on": False}
    last.register_forward_hook(lambda mod, args, out: out + 1.0 if faulty["on"] else None, prepend=True)
    losses, at_l3 = [], []
    for step in range(CLEAN + FAULTY + 10):
        faulty["on"] = CLEAN <= step < CLEAN + FAULTY
        out = model(**make_batch(step, torch.Generator().manual_seed(step)))
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out.loss.detach()))
        if "task_loss" in out:  # at L3: the task loss beside the total, and what the guard reports
            at_l3.append((float(out.loss.detach()), float(out["task_loss"].detach()), guard.summary()["loss"]))
        if step == CLEAN - 1:
            critical = [f for f in guard.findings if f.severity is Severity.CRITICAL]
            assert not critical, [f.message for f in critical]
    applied = [
        f.labels["action"]
        for f in guard.findings
        if f.reason is Reason.HEAL_ACTION
        and f.labels.get("result") == "applied"
        and f.labels.get("mpu_id") == vision.mpu_id
    ]
    guard.detach()
    assert applied[:2] == ["mark_suspect", "l1_swap"], applied
    assert "l3_distill" in applied, applied  # the fault outlasts L1 and L2
    assert at_l3 and all(total > task == pytest.approx(reported) for total, task, reported in at_l3)
    assert all(math.isfinite(v) for v in losses) and all(torch.isfinite(p).all() for p in model.parameters())
    assert min(losses[-10:]) < losses[0]  # still training after the fault


def test_blip2_clean_steps_pass_abft() -> None:
    """Blip2's vision qkv starts near zero (|W| ~1e-10) and Adam's first step takes it to ~1e-3:
    the |W| column sums that size the tolerance are refreshed 1, 2, 4, 8 steps after first
    sight, then every 16 (they were 16 steps stale: residual 8e-8 against a tolerance of 3e-11)."""
    model, make_batch = blip2(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = mscale.attach(model, opt, job_id="blip2", connect=False, checksum=mscale.ChecksumConfig(full=True))
    for step in range(20):
        model(**make_batch(step, torch.Generator().manual_seed(step))).loss.backward()
        opt.step()
        opt.zero_grad()
    failures = [f.message for f in guard.findings if f.reason in (Reason.CHECKSUM_FAILURE, Reason.NONFINITE_OUTPUT)]
    guard.detach()
    assert failures == []


def test_blip2_and_idefics3_layouts_are_discovered_with_nothing_left_out() -> None:
    """Fast: the MPUs of the layouts added for issue 23, and no uncovered-parameter warning."""
    from mscale.hook.core.mpu import discover, uncovered

    for build, names in (FAMILIES["idefics3"], FAMILIES["smolvlm"], FAMILIES["blip2"]):
        model, _ = build()
        mpus = discover(model)
        assert [m.name for m in mpus] == names
        assert uncovered(model, [m.module for m in mpus]) == []  # Blip2's query_tokens: 0.2%


def test_a_model_with_a_large_share_outside_every_mpu_is_warned_about_naming_the_modules() -> None:
    from mscale.hook.core.mpu import discover, uncovered

    model, _ = tiny_llava(seed=0)
    model.model.extra_head = torch.nn.Linear(32, 512)  # 16k parameters no MPU covers
    mpus = discover(model)
    assert uncovered(model, [m.module for m in mpus]) == ["model.extra_head"]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 116 default configs built on the meta device: minutes on a busy machine
def test_every_installed_multimodal_family_is_discovered_or_says_why() -> None:
    import warnings

    import transformers as T
    from transformers.models.auto import modeling_auto as auto

    from mscale.hook.core.mpu import MpuLayoutError, discover

    families = {**auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES, **auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES}
    found, missed = {}, {}
    for family, cls in sorted(families.items()):
        try:
            with warnings.catch_warnings(), torch.device("meta"):  # no memory, no initialisation
                warnings.simplefilter("ignore")
                model = getattr(T, cls)(T.AutoConfig.for_model(family))
        except Exception as e:  # a default config that does not build (or a missing optional package)
            missed[family] = f"does not build from its default config: {type(e).__name__}"
            continue
        try:
            names = {m.name for m in discover(model)}
        except MpuLayoutError:
            names = set()
        if names & {"vision", "audio"} and "text" in names:
            found[family] = names
        else:
            missed[family] = f"discovery finds {sorted(names)}"
    assert {f: missed[f] for f in sorted(missed) if f not in OUT_OF_SCOPE} == GAPS
    assert set(OUT_OF_SCOPE) <= set(missed)  # none of those is found with a tower and a text model
    assert {f for f, n in found.items() if "audio" in n} >= {"qwen2_audio", "qwen2_5_omni_thinker"}


def test_l3_in_an_encoder_decoder_pairs_each_image_with_its_own_decoder_states() -> None:
    """An encoder-decoder has no image placeholders: the term takes each sample's encoder rows
    against the mean of its decoder states, and is built (it used to say the student's positions
    were unknown)."""
    from mscale.hook.core.mpu import discover
    from mscale.hook.fuse.distill import Captured, Term

    model, _ = tf.vision_encoder_decoder(seed=0)
    mpus = discover(model)
    assert [m.name for m in mpus] == ["vision", "text"]
    term = Term(model, mpus, mpus[0])
    assert term.why_not() == "" and term.cross and term.token is None
    cap = Captured()
    cap.outputs["001"] = model.encoder(pixel_values=torch.randn(4, 3, 16, 16))
    cap.hidden = torch.randn(4, 7, 32)  # the decoder's final states (its LM head's input)
    cap.outputs["002"] = torch.randn(4, 7, 64)  # what the decoder returns: logits only
    loss, why = term.loss(cap)
    assert why == "" and loss is not None and math.isfinite(float(loss.detach()))
    loss.backward()
    assert model.encoder.embeddings.patch_embeddings.projection.weight.grad is not None
    cap.hidden = torch.randn(3, 7, 32)  # a teacher whose batch does not match: no term, and why
    assert term.loss(cap)[0] is None


@pytest.mark.parametrize("family", ["blip", "git", "vision_encoder_decoder"])
def test_l3_without_placeholders_is_applied_and_adds_its_term(family: str) -> None:
    """The layouts with no image placeholder: BLIP's decoder reads the tower by cross-attention
    (`encoder_hidden_states`), GIT puts the projected image before the caption, an encoder-decoder
    reads its encoder by cross-attention. L3 builds its term on each (it stopped at L2 saying the
    student's positions were unknown), and the next step's loss carries it."""
    model, make_batch = getattr(tf, family)(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = mscale.attach(model, opt, job_id=family, snapshots=True, connect=False)
    for step in range(2):
        model(**make_batch(step, torch.Generator().manual_seed(step))).loss.backward()
        opt.step()
        opt.zero_grad()
    fuse, m = guard.fuse, guard.mpu("vision")
    assert fuse.run(fuse_decision(fuse, m, "l3_distill", step=1)) == "applied"
    out = model(**make_batch(2, torch.Generator().manual_seed(2)))
    guard.detach()
    assert "task_loss" in out and float(out.loss) > float(out["task_loss"])
