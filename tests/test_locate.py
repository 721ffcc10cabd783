"""The layer a fault is in, found on the event (mscale.hook.checks.locate): faults the checks see
only at an MPU's output or in the loss, each injected by this test's own hooks on the tiny LLaVA
trained under `mscale.attach`, and the finding that reports them naming the layer, not only the
MPU: a NaN from one GEMM in a step its linear was not checked (the forward's autograd graph),
noise at a linear's input (a profiled re-run against the first forward's profile), an Inf
written into `lm_head`'s `exp_avg` (a scan of the weights and optimizer state on the non-finite
loss). A clean run names nothing and re-runs each MPU once (the baseline), never per step."""

from __future__ import annotations

import math

import torch

import mscale
from mscale.findings import Finding, Reason
from mscale.hook.checks.locate import (
    FLOOR,
    call_order,
    departure,
    graph_blame,
    nonfinite_state,
    owners,
    profile,
    read,
)
from support.tiny_hf import tiny_llava

TEXT = "model.language_model"
VISION = "model.vision_tower"
FAULT_AT = 12


def _nan_once(state: dict) -> object:
    """A forward hook: one element of the output NaN on the first call while state["on"] (a
    transient fault in the GEMM: a re-run of it computes right)."""

    def hook(module: torch.nn.Module, args: object, out: torch.Tensor) -> torch.Tensor | None:
        if not state["on"]:
            return None
        state["on"] = False
        bad = out.detach().clone()
        bad.view(-1)[7] = math.nan
        return out + (bad - out.detach())

    return hook


def _train(model, make_batch, steps: int, each_step=lambda step, guard: None) -> list[Finding]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = mscale.attach(model, opt, job_id="locate", connect=False)
    try:
        for step in range(steps):
            each_step(step, guard)
            out = model(**make_batch(step, torch.Generator().manual_seed(step)))
            out.loss.backward()
            opt.step()
            opt.zero_grad()
        return list(guard.findings)
    finally:
        guard.detach()


def test_the_graph_names_the_linear_whose_output_went_non_finite_and_nothing_when_all_is_finite() -> None:
    model, make_batch = tiny_llava(seed=0)
    params = owners(model.model.language_model, TEXT)
    seen: list[torch.Tensor] = []
    model.model.language_model.register_forward_hook(lambda m, a, out: seen.append(out.last_hidden_state))
    batch = make_batch(0, torch.Generator().manual_seed(0))
    order = call_order(read(profile(model.model.language_model, TEXT, lambda: model(**batch))))
    assert graph_blame(seen[-1:], params, order) is None  # finite: no blame
    for name in ("layers.1.mlp.up_proj", "layers.0.self_attn.o_proj", "layers.1.mlp.down_proj"):
        state = {"on": True}
        h = model.get_submodule(f"{TEXT}.{name}").register_forward_hook(_nan_once(state))
        out = model(**batch)
        h.remove()
        assert not torch.isfinite(seen[-1]).all()
        assert graph_blame(seen[-1:], params, order) == f"{TEXT}.{name}", name
    out.loss.backward()  # the graph's saved tensors are freed: it tells nothing
    assert graph_blame(seen[-1:], params, order) is None


def test_the_graph_walk_looks_past_the_minus_inf_a_masked_attention_saves() -> None:
    """torch's own encoder layer with a padding mask: its attention saves -Inf (the mask, a
    masked row's log-sum-exp) in every forward; a NaN after it is still traced to its linear."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    x = torch.randn(2, 6, 16, requires_grad=True)
    pad = torch.tensor([[False] * 6, [False] * 3 + [True] * 3])
    state = {"on": True}
    layer.linear1.register_forward_hook(_nan_once(state))
    order = call_order(read(profile(layer, "enc", lambda: layer(x.detach(), src_key_padding_mask=pad))))
    state["on"] = True
    out = layer(x, src_key_padding_mask=pad)
    assert not torch.isfinite(out).all()
    assert graph_blame([out], owners(layer, "enc"), order) == "enc.linear1"


def test_a_transient_nan_from_a_gemm_is_blamed_on_its_linear_not_its_mpu() -> None:
    model, make_batch = tiny_llava(seed=0)
    state = {"on": False}
    model.get_submodule(f"{TEXT}.layers.1.mlp.up_proj").register_forward_hook(_nan_once(state), prepend=True)

    def arm(step: int, guard: object) -> None:
        state["on"] = step == FAULT_AT

    findings = _train(model, make_batch, FAULT_AT + 2, arm)
    nonfinite = [f for f in findings if f.reason is Reason.NONFINITE_OUTPUT]
    assert nonfinite and all(f.labels["step"] == str(FAULT_AT) for f in nonfinite)
    assert {f.labels["layer"] for f in nonfinite} == {f"{TEXT}.layers.1.mlp.up_proj"}


def test_noise_at_a_linears_input_found_by_the_output_statistics_is_blamed_on_that_linear() -> None:
    model, make_batch = tiny_llava(seed=0)
    state = {"on": False}
    gen = torch.Generator().manual_seed(5)

    def noise(module: torch.nn.Module, args: tuple) -> tuple | None:
        if not state["on"]:
            return None
        x = args[0]
        return (x + 100.0 * torch.randn(x.shape, generator=gen), *args[1:])

    model.get_submodule(f"{VISION}.encoder.layers.1.mlp.fc2").register_forward_pre_hook(noise, prepend=True)

    def arm(step: int, guard: object) -> None:
        state["on"] = step >= FAULT_AT

    findings = _train(model, make_batch, FAULT_AT + 6, arm)
    shifts = [f for f in findings if f.reason is Reason.OUTPUT_SHIFT]
    assert shifts, [f.reason.value for f in findings]
    assert shifts[0].labels["layer"] == f"{VISION}.encoder.layers.1.mlp.fc2", shifts[0].labels


def test_an_inf_in_lm_heads_exp_avg_is_named_on_the_non_finite_loss_and_a_clean_run_names_nothing() -> None:
    model, make_batch = tiny_llava(seed=0)
    calls = {"n": 0}

    def rerun_count(module: torch.nn.Module, args: object, out: object) -> None:
        calls["n"] += 1

    def arm(step: int, guard: object) -> None:
        if step == 0:
            opt = guard.optimizer  # type: ignore[attr-defined]
            model.get_submodule(VISION).register_forward_hook(rerun_count)

            def poison(o: torch.optim.Optimizer, args: object, kwargs: object) -> None:
                if guard.current_step == FAULT_AT:  # type: ignore[attr-defined]
                    o.state[model.lm_head.weight]["exp_avg"].view(-1)[3] = math.inf

            opt.register_step_pre_hook(poison)  # after the guard's own: the update carries it

    findings = _train(model, make_batch, FAULT_AT + 2, arm)
    before = [f for f in findings if int(f.labels["step"]) <= FAULT_AT and f.severity.value != "info"]
    assert not before  # the clean steps raised nothing
    loss = [f for f in findings if f.reason is Reason.LOSS_NONFINITE]
    assert loss and all("lm_head.weight" in f.labels.get("tensor", "").split(",") for f in loss), loss
    assert "lm_head.weight:exp_avg" in loss[0].labels["tensor"]
    assert calls["n"] == (FAULT_AT + 2) + 1  # a forward a step, the baseline's re-run once, and no other


def test_the_weights_and_state_scan_names_only_non_finite_tensors() -> None:
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert nonfinite_state(lin, opt) == []
    with torch.no_grad():
        opt.state[lin.bias]["exp_avg_sq"][1] = math.nan
    assert nonfinite_state(lin, opt) == ["bias:exp_avg_sq"]


def test_the_submodule_that_moved_most_is_named_when_the_mpus_output_moved() -> None:
    base = [("m.a", 0.0), ("m.b", 0.0), ("m.b.c", 0.0), ("m.c", 0.0), ("m", 0.0)]
    drift = [("m.a", 1.0), ("m.b", 3.0), ("m.b.c", 3.0), ("m.c", 2.0), ("m", 2.5)]
    assert departure(drift, base, "m") == "m.b"  # most moved; its container after it is the same move
    quiet = [("m.a", 1.0), ("m.b", 0.1), ("m.b.c", 0.1), ("m.c", 0.1), ("m", FLOOR / 2)]
    assert departure(quiet, base, "m") is None  # the re-run does not show the shift
    assert departure([("m.a", 0.0), ("m.b", math.nan), ("m", math.nan)], base, "m") == "m.b"
