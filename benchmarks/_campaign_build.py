"""Writes the shipped campaigns, benchmarks/campaigns/full.json and ci.json, in lm-resiliency
0.2.0's incident schema (benchmarks/_campaign_schema.py), from the sites below: every MPU of
the tiny LLaVA and Qwen2-VL, their lm_head and embeddings, crossed with the operations,
magnitudes and timings round-robin (deterministic: the same files every time).

    python benchmarks/_campaign_build.py      # rewrites both files
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "campaigns"
START = 20  # the first faulty step of a 40-step run (every fault's trigger)

# (op, magnitude, scope)
COMBOS = [
    ("single_bitflip", "catastrophic", "single"),
    ("set_value", "nan", "single"),
    ("scale", "medium", "row"),
    ("single_bitflip", "medium", "single"),
    ("noise", "large", "10%"),
    ("multi_bitflip", "large", "single"),
    ("scale", "subtle", "100%"),
    ("set_value", "inf", "single"),
    ("noise", "subtle", "100%"),
    ("sign_flip", "medium", "row"),
    ("single_bitflip", "near_invisible", "single"),
    ("scale", "large", "1%"),
    ("noise", "medium", "10%"),
    ("single_bitflip", "large", "single"),
    ("multi_bitflip", "subtle", "single"),
    ("noise", "near_invisible", "100%"),
    ("scale", "catastrophic", "single"),
    ("single_bitflip", "subtle", "single"),
]
TIMINGS = ["transient", "persistent", "bounded", "follows"]


def _llava() -> list[tuple[str, str, str, str]]:
    """(surface, module_path, mpu, parameter) sites of the tiny LLaVA."""
    v, t, p = "model.vision_tower", "model.language_model", "model.multi_modal_projector"
    sites = []
    for i in (0, 1):
        vl, tl = f"{v}.encoder.layers.{i}", f"{t}.layers.{i}"
        sites += [("compute", f"{vl}.self_attn.q_proj", "vision", ""), ("compute", f"{vl}.mlp.fc1", "vision", "")]
        sites += [("input", f"{vl}.mlp.fc2", "vision", ""), ("output", f"{vl}.layer_norm1", "vision", "")]
        sites += [("output", f"{vl}.self_attn", "vision", ""), ("output", f"{vl}", "vision", "")]
        sites += [("weight", f"{vl}.mlp.fc2", "vision", ""), ("gradient", f"{vl}.self_attn.v_proj", "vision", "")]
        sites += [("optimizer_state", f"{vl}.mlp.fc1", "vision", "exp_avg")]
        sites += [("compute", f"{tl}.self_attn.k_proj", "text", ""), ("compute", f"{tl}.mlp.up_proj", "text", "")]
        sites += [("input", f"{tl}.mlp.down_proj", "text", ""), ("output", f"{tl}.input_layernorm", "text", "")]
        sites += [("output", f"{tl}.self_attn", "text", ""), ("output", tl, "text", "")]
        sites += [("weight", f"{tl}.self_attn.o_proj", "text", ""), ("gradient", f"{tl}.mlp.gate_proj", "text", "")]
        sites += [("optimizer_state", f"{tl}.mlp.down_proj", "text", "exp_avg_sq")]
    sites += [("compute", f"{p}.linear_1", "projector", ""), ("input", f"{p}.linear_2", "projector", "")]
    sites += [("weight", f"{p}.linear_1", "projector", ""), ("gradient", f"{p}.linear_2", "projector", "")]
    sites += [("optimizer_state", f"{p}.linear_1", "projector", "exp_avg"), ("output", p, "projector", "")]
    sites += [("output", v, "vision", ""), ("output", f"{v}.post_layernorm", "vision", "")]
    sites += [("compute", "lm_head", "lm_head", ""), ("weight", "lm_head", "lm_head", "")]
    sites += [("gradient", "lm_head", "lm_head", ""), ("optimizer_state", "lm_head", "lm_head", "exp_avg")]
    sites += [("weight", f"{t}.embed_tokens", "embeddings", ""), ("output", f"{t}.embed_tokens", "embeddings", "")]
    sites += [
        ("gradient", f"{t}.embed_tokens", "embeddings", ""),
        ("weight", f"{v}.embeddings.patch_embedding", "embeddings", ""),
    ]
    sites += [("data", "", "data", ""), ("loss", "", "loss", "")]
    return sites


def _qwen2vl() -> list[tuple[str, str, str, str]]:
    v, t = "model.visual", "model.language_model"
    sites = []
    for i in (0, 1):
        vb, tl = f"{v}.blocks.{i}", f"{t}.layers.{i}"
        sites += [("compute", f"{vb}.attn.qkv", "vision", ""), ("compute", f"{vb}.mlp.fc1", "vision", "")]
        sites += [("input", f"{vb}.mlp.fc2", "vision", ""), ("output", f"{vb}.norm1", "vision", "")]
        sites += [("output", f"{vb}.attn", "vision", ""), ("output", vb, "vision", "")]
        sites += [("weight", f"{vb}.mlp.fc2", "vision", ""), ("gradient", f"{vb}.attn.proj", "vision", "")]
        sites += [("optimizer_state", f"{vb}.mlp.fc1", "vision", "exp_avg")]
        sites += [("compute", f"{tl}.self_attn.q_proj", "text", ""), ("compute", f"{tl}.mlp.gate_proj", "text", "")]
        sites += [
            ("input", f"{tl}.mlp.down_proj", "text", ""),
            ("output", f"{tl}.post_attention_layernorm", "text", ""),
        ]
        sites += [("output", f"{tl}.self_attn", "text", ""), ("output", tl, "text", "")]
        sites += [("weight", f"{tl}.self_attn.v_proj", "text", ""), ("gradient", f"{tl}.mlp.up_proj", "text", "")]
        sites += [("optimizer_state", f"{tl}.self_attn.q_proj", "text", "exp_avg_sq")]
    sites += [("compute", f"{v}.merger.mlp.0", "projector", ""), ("input", f"{v}.merger.mlp.2", "projector", "")]
    sites += [("weight", f"{v}.merger.mlp.2", "projector", ""), ("output", f"{v}.merger.ln_q", "projector", "")]
    sites += [("compute", "lm_head", "lm_head", ""), ("weight", "lm_head", "lm_head", "")]
    sites += [("gradient", "lm_head", "lm_head", ""), ("optimizer_state", "lm_head", "lm_head", "exp_avg")]
    sites += [("weight", f"{t}.embed_tokens", "embeddings", ""), ("output", f"{t}.embed_tokens", "embeddings", "")]
    sites += [("data", "", "data", ""), ("loss", "", "loss", "")]
    return sites


def incident(n: int, model: str, site: tuple[str, str, str, str], combo: tuple, timing: str) -> dict:
    surface, path, mpu, extra = site
    op, magnitude, scope = combo
    params: dict = {"operation": op, "scope": scope}
    if op == "set_value":
        params["value"] = magnitude
    else:
        params["magnitude"] = magnitude
    target: dict = {"surface": surface, "rank": 0, "metadata": {"model": model, "mpu": mpu}}
    if surface == "loss":
        target.update(surface="output", operation="loss")
    elif surface == "data":
        target["path"] = "pixel_values"
    else:
        target["module_path"] = path
    if surface in ("weight", "gradient", "optimizer_state"):
        params["parameter"] = "weight"
    if surface == "optimizer_state":
        params["state_key"] = extra
    lifetime = {"until": "campaign_end"} if timing == "persistent" else {"iterations": 3 if timing == "bounded" else 1}
    fid = f"{model}-{n:03d}-{surface}-{op}-{magnitude}-{timing}"
    return {
        "incident_id": fid,
        "trigger": {"at": [START]},
        "lifetime": lifetime,
        "retrigger": "every_attempt" if timing == "follows" else "once",
        "faults": [{"fault_id": fid, "type": "tensor_corruption", "target": target, "parameters": params}],
    }


def full() -> list[dict]:
    out, n = [], 0
    for model, sites in (("llava", _llava()), ("qwen2vl", _qwen2vl())):
        combos, timings = itertools.cycle(COMBOS), itertools.cycle(TIMINGS)
        for _ in range(3):  # three faults a site, each a different combination
            for site in sites:
                out.append(incident(n, model, site, next(combos), next(timings)))
                n += 1
    return out


def ci() -> list[dict]:
    """24 faults on the tiny LLaVA: every surface three times, every MPU, lm_head and the
    embeddings, catastrophic to near-invisible, the four timings."""
    pick = {s[1] + s[0]: s for s in _llava()}
    v, t, p = "model.vision_tower.encoder.layers", "model.language_model", "model.multi_modal_projector"
    chosen = [
        (f"{v}.0.mlp.fc1compute", 0, "transient"),
        (f"{t}.layers.1.mlp.up_projcompute", 1, "transient"),
        ("lm_headcompute", 3, "persistent"),
        (f"{v}.1.mlp.fc2input", 4, "bounded"),
        (f"{t}.layers.0.mlp.down_projinput", 9, "transient"),
        (f"{p}.linear_2input", 6, "follows"),
        (f"{v}.0.layer_norm1output", 2, "transient"),
        (f"{t}.layers.1output", 5, "bounded"),
        ("model.vision_toweroutput", 12, "persistent"),
        (f"{v}.1.mlp.fc2weight", 13, "transient"),
        (f"{t}.embed_tokensweight", 0, "transient"),
        ("lm_headweight", 10, "persistent"),
        (f"{v}.0.self_attn.v_projgradient", 16, "transient"),
        (f"{t}.layers.1.mlp.gate_projgradient", 4, "bounded"),
        (f"{p}.linear_2gradient", 11, "transient"),
        (f"{v}.0.mlp.fc1optimizer_state", 16, "transient"),
        (f"{t}.layers.1.mlp.down_projoptimizer_state", 2, "bounded"),
        ("lm_headoptimizer_state", 7, "transient"),
        ("data", 1, "transient"),
        ("data", 8, "bounded"),
        ("data", 14, "transient"),
        ("loss", 7, "transient"),
        ("loss", 17, "follows"),
        ("loss", 3, "transient"),
    ]
    return [incident(n, "llava", pick[key], COMBOS[c], timing) for n, (key, c, timing) in enumerate(chosen)]


def write() -> None:
    OUT.mkdir(exist_ok=True)
    for name, incidents in (("full", full()), ("ci", ci())):
        doc = {
            "schema_version": 1,
            "name": f"mscale-{name}",
            "seed": 0,
            "clock": {"type": "training_iteration", "origin": "training_run"},
            "metadata": {"generator": "benchmarks/_campaign_build.py", "steps": 40},
            "incidents": incidents,
        }
        (OUT / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(f"{name}.json: {len(incidents)} faults")


if __name__ == "__main__":
    write()
