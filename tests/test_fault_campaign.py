"""The fault campaign (issue 37): the 24-fault CI campaign (benchmarks/campaigns/ci.json) run
on the tiny LLaVA, left alone and under the README's line, each fault injected by the
campaign's own hooks, and the acceptance thresholds asserted on its ground truth. Thresholds
today's guard does not meet are strict xfails that carry the figure measured.

The schema reader and the injector are checked first, on their own: a bad campaign is refused
by name, each operation changes what it says it does, and a left-alone NaN fault ruins the
run (so the ground truth can tell a fault that matters).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the benchmarks are imported as the package they are run as
    sys.path.insert(0, str(ROOT))

from benchmarks import _campaign_build  # noqa: E402
from benchmarks._campaign_inject import Injector, corrupt_tensor, corrupted  # noqa: E402
from benchmarks._campaign_run import build, run  # noqa: E402
from benchmarks._campaign_schema import CampaignError, load  # noqa: E402
from benchmarks._campaign_score import blamed  # noqa: E402
from benchmarks.fault_campaign import campaign, runner  # noqa: E402

CAMPAIGNS = ROOT / "benchmarks" / "campaigns"
STEPS = 40


def _campaign(tmp_path: Path, **change) -> Path:
    doc = json.loads((CAMPAIGNS / "ci.json").read_text())
    inc = doc["incidents"][0]
    for key, value in change.items():
        where, _, name = key.partition("__")  # incident__x, fault__x, target__x, parameters__x
        fault = inc["faults"][0]
        {"incident": inc, "fault": fault}.get(where, fault.get(where, {}))[name] = value
    p = tmp_path / "c.json"
    p.write_text(json.dumps(doc))
    return p


def test_the_shipped_campaigns_are_what_the_builder_writes_and_cover_every_surface() -> None:
    for name, incidents in (("full", _campaign_build.full()), ("ci", _campaign_build.ci())):
        assert json.loads((CAMPAIGNS / f"{name}.json").read_text())["incidents"] == incidents, name
    _, full = load(CAMPAIGNS / "full.json")
    _, ci = load(CAMPAIGNS / "ci.json")
    assert len(full) >= 300 and len(ci) == 24
    surfaces = {"compute", "input", "output", "weight", "gradient", "optimizer_state", "data", "loss"}
    assert {f.surface for f in ci} == surfaces == {f.surface for f in full}
    assert {f.timing for f in full} == {"transient", "bounded", "persistent", "follows"}
    assert {f.model for f in full} == {"llava", "qwen2vl"}
    assert {"lm_head", "embeddings", "vision", "projector", "text"} <= {f.labels["mpu"] for f in full}


def test_every_target_of_the_full_campaign_is_in_its_model() -> None:
    _, faults = load(CAMPAIGNS / "full.json")
    models = {name: build(name, 0)[0] for name in ("llava", "qwen2vl")}
    for f in faults:
        model = models[f.model]
        Injector(f, model, torch.optim.AdamW(model.parameters())).remove()  # a wrong target raises, naming it
    with pytest.raises(ValueError, match="no module 'model.nowhere'"):
        Injector(replace(faults[0], module_path="model.nowhere"), models["llava"], torch.optim.SGD([torch.ones(1)]))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"target__surface": "disk"}, "target.surface"),
        ({"parameters__operation": "melt"}, "parameters.operation"),
        ({"parameters__scope": "half"}, "parameters.scope"),
        ({"incident__lifetime": {"forever": True}}, "lifetime"),
        ({"incident__trigger": {"at": [0]}}, "positive integer"),
        ({"fault__type": "hang"}, "tensor_corruption only"),
        ({"target__colour": "red"}, "unknown keys ['colour']"),
    ],
)
def test_a_campaign_outside_the_schema_is_refused_naming_the_field(tmp_path: Path, change: dict, named: str) -> None:
    with pytest.raises(CampaignError, match="incident 0") as e:
        load(_campaign(tmp_path, **change))
    assert named in str(e.value)


def test_each_operation_changes_the_values_as_its_magnitude_says() -> None:
    _, faults = load(CAMPAIGNS / "full.json")
    one = {(f.op, f.magnitude): f for f in faults}
    x = torch.tensor([0.75])
    assert float(corrupted(x, one[("single_bitflip", "catastrophic")], 0)) > 1e30  # the exponent's top bit
    near = float(corrupted(x, one[("single_bitflip", "near_invisible")], 0))
    assert near != 0.75 and abs(near - 0.75) < 1e-6  # the mantissa's lowest bit
    assert math.isnan(float(corrupted(x, one[("set_value", "nan")], 0)))
    assert float(corrupted(x, one[("set_value", "inf")], 0)) == math.inf
    assert float(corrupted(x, one[("scale", "medium")], 0)) == pytest.approx(7.5)
    assert float(corrupted(x, one[("sign_flip", "medium")], 0)) == -0.75
    w = torch.ones(8, 16, requires_grad=True)
    bad = corrupt_tensor(w, one[("sign_flip", "medium")], 3)  # scope "row": one row of 16
    assert int((bad != w).sum()) == 16
    bad.sum().backward()
    assert torch.equal(w.grad, torch.ones(8, 16))  # a wrong value, not a different function


def test_a_nan_fault_left_alone_ruins_the_run_and_the_same_run_without_it_does_not() -> None:
    _, faults = load(CAMPAIGNS / "ci.json")
    nan = next(f for f in faults if f.magnitude == "nan" and f.surface == "compute")
    bare = run("llava", nan, guarded=False, steps=nan.start + 2, max_calls=nan.start + 2)
    assert bare["armed"] == [nan.start] and not bare["finite"]
    clean = run("llava", None, guarded=False, steps=nan.start + 2, max_calls=nan.start + 2)
    assert clean["finite"] and math.isfinite(clean["held_out"])


def test_both_models_train_in_the_runner_and_a_loss_fault_reaches_the_gradients() -> None:
    """Qwen2-VL's batches go through the loader whole (its patches are rows of the whole batch);
    a loss fault scales what is trained on, not only the number reported."""
    for model in ("llava", "qwen2vl"):
        r = run(model, None, guarded=False, steps=3, max_calls=3)
        assert r["error"] is None and r["calls"] == 3 and r["finite"], (model, r["error"])
    _, faults = load(CAMPAIGNS / "ci.json")
    inf = next(f for f in faults if f.surface == "loss" and f.magnitude == "inf")
    bare = run("llava", inf, guarded=False, steps=inf.start + 1, max_calls=inf.start + 1)
    assert bare["armed"] == [inf.start] and not bare["finite"]


def test_the_right_layer_is_a_finding_naming_the_layer_or_a_module_or_tensor_inside_it() -> None:
    layer = "model.language_model.layers.1"
    assert blamed({"layer": "model.language_model.layers.1.mlp.up_proj"}, layer)
    assert blamed({"tensor": "module.model.language_model.layers.1.mlp.up_proj.weight"}, layer)  # under DDP
    assert blamed({"tensor": "lm_head.weight,model.language_model.layers.1.mlp.up_proj.weight"}, layer)
    assert not blamed({"layer": "model.language_model.layers.10.mlp.up_proj"}, layer)  # another layer
    assert not blamed({"layer": "model.language_model", "mpu_id": "003"}, layer)  # the MPU alone
    assert not blamed({}, layer)


# -- the CI campaign, once for every threshold below


@pytest.fixture(scope="module")
def ci() -> dict:
    torch.set_num_threads(1)
    _, faults = load(CAMPAIGNS / "ci.json")
    return campaign(faults, STEPS, log=lambda s: None)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the first one runs the campaign (about 3 min on 2 cores)
def test_the_campaign_has_faults_that_matter_and_faults_that_do_not(ci: dict) -> None:
    s = ci["all"]
    assert s["faults"] == 24 and 0 < s["mattered"] < 24, s


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the first one runs the campaign (about 3 min on 2 cores)
def test_no_crashes(ci: dict) -> None:
    assert ci["all"]["crashes"] == 0, [r for r in ci["faults"] if r["crash"]]


def _figure(ci: dict, num: str, den: str) -> str:
    s = ci["all"]
    return f"{s[num]}/{s[den]}"


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the first one runs the campaign (about 3 min on 2 cores)
def test_at_least_95_percent_of_the_faults_that_matter_are_detected(ci: dict) -> None:
    s = ci["all"]
    assert s["detected_of_mattered"] >= 0.95 * s["mattered"], _figure(ci, "detected_of_mattered", "mattered")


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the first one runs the campaign (about 3 min on 2 cores)
def test_at_least_90_percent_of_all_faults_are_detected_or_harmless(ci: dict) -> None:
    s = ci["all"]
    assert s["detected_or_harmless"] >= 0.90 * s["faults"], _figure(ci, "detected_or_harmless", "faults")


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the first one runs the campaign (about 3 min on 2 cores)
@pytest.mark.xfail(
    strict=True,
    reason="measured 5/8 (62%): a NaN GEMM found at its MPU's output in a step its linear was not checked, an input fault found by the MPU's output statistics and an Inf exp_avg found by the loss name the MPU or nothing, not the layer (docs/campaign.md)",
)
def test_the_right_layer_is_named_for_at_least_90_percent_of_detections(ci: dict) -> None:
    s = ci["all"]
    assert s["right_layer"] >= 0.90 * s["layer_known"], _figure(ci, "right_layer", "layer_known")


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the first one runs the campaign (about 3 min on 2 cores)
def test_every_fault_that_matters_is_healed_or_stopped_cleanly(ci: dict) -> None:
    s = ci["all"]
    assert s["healed_of_mattered"] == s["mattered"], [r["fault"] for r in ci["faults"] if r["escaped"]]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the first one runs the campaign (about 3 min on 2 cores)
def test_no_loops(ci: dict) -> None:
    assert ci["all"]["loops"] == 0, [r["fault"] for r in ci["faults"] if r["loop"]]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the first one runs the campaign (about 3 min on 2 cores)
def test_at_most_one_warning_and_no_critical_per_1000_clean_steps(ci: dict) -> None:
    fa = ci["false_alarms"]
    assert fa["clean_steps"] >= STEPS
    assert fa["critical"] == 0 and fa["warning_per_1000"] <= 1.0, fa


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_ddp_a_nan_gemm_on_rank_1_is_detected_healed_and_blamed_on_rank_1_and_its_mpu() -> None:
    """The DDP set-up: 2 gloo ranks, the fault on rank 1 (each run its own forked process group)."""
    _, faults = load(CAMPAIGNS / "ci.json")
    nan = [f for f in faults if f.magnitude == "nan" and f.surface == "compute"]
    res = campaign(nan, nan[0].start + 4, log=lambda s: None, run=runner("ddp", str(CAMPAIGNS / "ci.json")))
    row = res["faults"][0]
    assert row["mattered"] and row["detected"] and row["steps_to_detection"] == 0, row
    assert row["right_rank"] and row["right_mpu"] and row["healed"] and not row["loop"], row
