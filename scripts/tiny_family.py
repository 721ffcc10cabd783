"""A tiny model of any installed Hugging Face multimodal family, built offline from its default
config, and a batch maker whose captions depend on the image (or the clip): what
scripts/families_sweep.py trains. Nothing is downloaded.

    model, make_batch, how = tiny(family)        # how: the input recipe that worked
    batch = make_batch(step, torch.Generator().manual_seed(step))

The config: every width, depth, head count, expert count and vocabulary of the default config and
its sub-configs shrunk to a few units (hidden 32, 2 layers, 4 heads of 8, vocabulary 512, 32-pixel
images in 4-pixel patches), per-layer lists cut to the new depth, special token ids past the new
vocabulary moved to its top. The families the tests build by hand (tests/support/tiny_hf.py,
tiny_families.py) take those builders instead.

The batch: each of 8 classes has its own image pattern (or log-mel pattern) and its own 6-token
caption; the placeholders before the caption are the model's image (or audio) token, as many
as the model makes features, found by asking the model (its "features and tokens do not match"
error names the count). The input layout is tried in turn: pixels (B, 3, H, W), pixels with an
image axis (B, 1, 3, H, W), flattened patches with `image_grid_thw` (the Qwen2-VL layout), each
with the extras the forward takes (`image_sizes`, `token_type_ids`, masks); audio as log-mel
features (B, mels, frames) with their mask.
"""

from __future__ import annotations

import copy
import inspect
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers as T
from transformers.models.auto import modeling_auto as auto

BATCH, CLASSES, CAPTION, VOCAB = 4, 8, 6, 512
HIDDEN, FFN, LAYERS, HEADS, HEAD_DIM = 32, 64, 2, 4, 8
IMAGE, PATCH = 32, 4
MELS, FRAMES = 16, 64

# config keys -> their tiny value (a key present in a config, or a sub-config, is set)
SIZES: dict[str, int] = {
    **dict.fromkeys(
        ("hidden_size", "d_model", "embed_dim", "n_embd", "out_hidden_size", "projection_dim", "word_embed_proj_dim"),
        HIDDEN,
    ),
    **dict.fromkeys(
        (
            "intermediate_size",
            "ffn_dim",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "d_ff",
            "n_inner",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "projector_hidden_size",
            "text_intermediate_size",
            "vision_intermediate_size",
        ),
        FFN,
    ),
    **dict.fromkeys(
        (
            "num_hidden_layers",
            "num_layers",
            "encoder_layers",
            "decoder_layers",
            "depth",
            "n_layer",
            "num_decoder_layers",
            "num_encoder_layers",
        ),
        LAYERS,
    ),
    **dict.fromkeys(
        ("num_attention_heads", "encoder_attention_heads", "decoder_attention_heads", "num_heads", "n_head"), HEADS
    ),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads"), HEADS),
    **dict.fromkeys(("head_dim", "d_kv", "kv_channels", "dim_head"), HEAD_DIM),
    **dict.fromkeys(("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts"), 1),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), HEAD_DIM // 2),  # their sum is the head dim
    "v_head_dim": HEAD_DIM,
    **dict.fromkeys(
        (
            "text_hidden_size",
            "audio_hidden_size",
            "vision_hidden_size",
            "hidden_dim",
            "vision_output_dim",
            "projector_input_dim",
            "projector_output_dim",
            "encoder_hidden_size",  # a Q-Former's cross-attention input: the encoder's width
        ),
        HIDDEN,
    ),
    "mm_tokens_per_image": 16,  # Gemma3's pooled tokens per image: an 8x8 patch grid pooled 2x2
    "vocab_size": VOCAB,
    "image_size": IMAGE,
    "patch_size": PATCH,
    "max_source_positions": FRAMES // 2,  # Whisper-style audio encoders take exactly twice as many frames
}
DERIVED = ("head_dim", "num_key_value_heads")  # None in some defaults (derived from the large sizes): set too
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "encoder_layers", "decoder_layers", "depth", "n_layer")
TOKEN_KEY = re.compile(r"(_token_id|_token_index|_token|_id)$")


def families() -> dict[str, str]:
    """Every family the installed transformers maps as image-text-to-text or multimodal LM: its model class."""
    return dict(
        sorted(
            {**auto.MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES, **auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES}.items()
        )
    )


def _shrink(d: dict[str, Any]) -> dict[str, Any]:
    """One config dict (and its sub-config dicts) with the SIZES applied and per-layer lists cut."""
    old_layers = next((d[k] for k in LAYER_COUNTS if isinstance(d.get(k), int)), None)
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and old_layers and all(str(i).isdigit() for i in v):
            out[k] = {LAYERS - 1: next(iter(v.values()))}  # per-layer overrides: one, on the last layer
        elif isinstance(v, dict) and (k.endswith("_config") or "model_type" in v):
            out[k] = _shrink(v)
        elif k in SIZES and (isinstance(v, int) and not isinstance(v, bool) and v > 0 or v is None and k in DERIVED):
            out[k] = SIZES[k]
        elif k == "projector_patch_to_query_dict":  # Aria: the queries its projector makes per patch count
            out[k] = {(IMAGE // PATCH) ** 2: 16}
        elif k in SIZES and isinstance(v, (list, tuple)) and v and all(isinstance(i, int) for i in v):
            out[k] = [SIZES[k]] * len(v)  # per-stage widths and head counts (DaViT's), image and patch sizes
        elif k == "depths" and isinstance(v, (list, tuple)) and v and all(isinstance(i, int) for i in v):
            out[k] = [1] * len(v)  # layers per stage
        elif isinstance(v, list) and old_layers and len(v) == old_layers and old_layers > LAYERS:
            out[k] = _layers(v)  # layer_types, per-layer flags
        elif "feature_layer" in k and isinstance(v, (int, list)):
            out[k] = _feature_layers(v)
        elif k == "image_grid_pinpoints" and isinstance(v, list):
            out[k] = [[IMAGE, IMAGE]]
        elif isinstance(v, list) and v and ("index" in k or "layer_map" in k) and all(isinstance(i, int) for i in v):
            out[k] = [i for i in v if isinstance(i, int) and 0 <= i < LAYERS] or [0]  # layer indexes
        elif k in ("rope_parameters", "rope_scaling") and isinstance(v, dict):
            out[k] = _rope(v, SIZES["qk_rope_head_dim"] // 2 if "qk_rope_head_dim" in d else HEAD_DIM // 2)
        else:
            out[k] = v
    return out


def _layers(v: list) -> list:
    """A per-layer list cut to LAYERS entries, keeping a second kind where there is one (a hybrid
    model's full-attention layer beside its linear-attention ones)."""
    other = next((x for x in v if x != v[0]), None)
    return [v[0]] * (LAYERS - 1) + [other] if other is not None else v[:LAYERS]


def _feature_layers(v: int | list) -> int | list:
    """Hidden-state indexes into a tower of LAYERS layers (LAYERS + 1 states), as many as before."""

    def one(i: int) -> int:
        return max(i, -(LAYERS + 1)) if i < 0 else min(i, LAYERS - 1)

    return one(v) if isinstance(v, int) else [one(i) if isinstance(i, int) else i for i in v]


def _rope(v: dict[str, Any], total: int = HEAD_DIM // 2, force: bool = False) -> dict[str, Any]:
    """M-RoPE's sections (t, h, w) summing to `total`, half the rotary dims; `force`: set where
    the config leaves them to the model's default (Qwen2.5-VL's and GLM-4V's [16, 24, 24])."""
    v = copy.deepcopy(v)
    a = total // 4
    b = (total - a) // 2
    for sub in [v, *(x for x in v.values() if isinstance(x, dict))]:
        sec = sub.get("mrope_section")
        if isinstance(sec, list) and sec:
            sub["mrope_section"] = [a, b, total - a - b] if len(sec) == 3 else [total // len(sec)] * len(sec)
    per_type = [x for x in v.values() if isinstance(x, dict)]  # rope parameters per layer type
    for sub in per_type or [v]:
        if force and "mrope_section" not in sub:
            sub["mrope_section"] = [a, b, total - a - b]
    return v


PLACEHOLDERS = ("image_token_id", "image_token_index", "audio_token_id", "audio_token_index")


def _tokens(d: dict[str, Any], taken: set[int]) -> None:
    """Special token ids past the tiny vocabulary moved to its top, and placeholder ids the
    processor would set (None in the config) given one (in place, sub-configs too)."""
    for k, v in list(d.items()):
        if isinstance(v, dict):
            _tokens(v, taken)
        elif (
            k in PLACEHOLDERS
            and v is None
            or isinstance(k, str)
            and TOKEN_KEY.search(k)
            and isinstance(v, int)
            and not isinstance(v, bool)
            and v >= VOCAB - 100
        ):
            new = next(i for i in range(VOCAB - 1, 100, -1) if i not in taken)
            taken.add(new)
            d[k] = new


def tiny_config(family: str) -> Any:
    cfg = T.AutoConfig.for_model(family)
    d = _shrink(cfg.to_dict())
    _tokens(d, set())
    d.pop("model_type", None)
    d.pop("transformers_version", None)
    tiny = type(cfg)(**d)
    for c in _configs(tiny):  # rope sections the config's own defaults filled in, or the model's
        force = "mrope_section" in getattr(c, "ignore_keys_at_rope_validation", ())
        for key in ("rope_parameters", "rope_scaling"):
            rope = _get(c, key)
            if isinstance(rope, dict):
                share = _get(c, "partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
                rotary = _get(c, "qk_rope_head_dim") or int((_get(c, "head_dim") or HEAD_DIM) * float(share))
                setattr(c, key, _rope(rope, rotary // 2, force))
    if getattr(tiny, "is_encoder_decoder", False):  # the decoder's inputs are the labels shifted right
        tiny.pad_token_id = getattr(tiny, "pad_token_id", None) or 0
        tiny.decoder_start_token_id = getattr(tiny, "decoder_start_token_id", None) or 1
    return tiny


def _get(c: Any, key: str) -> Any:
    """A config attribute, None where it is absent or per-layer only (Gemma4's head_dim raises)."""
    try:
        return getattr(c, key, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def _configs(cfg: Any) -> list[Any]:
    subs = [v for v in vars(cfg).values() if isinstance(v, T.PretrainedConfig)]
    return [cfg, *(c for sub in subs for c in _configs(sub))]


def placeholder(cfg: Any, modality: str) -> int | None:
    keys = ("audio_token_id", "audio_token_index") if modality == "audio" else ("image_token_id", "image_token_index")
    for c in _configs(cfg):
        for k in keys:
            v = getattr(c, k, None)
            if isinstance(v, int):
                return v
    return None


def special(cfg: Any) -> frozenset[int]:
    """The config's image, video and audio token ids below 100 (Pixtral's [IMG] is 10): captions avoid them."""
    ids = set()
    for c in _configs(cfg):
        for k, v in vars(c).items():
            media = any(w in k for w in ("image", "audio", "video", "vision"))
            if media and TOKEN_KEY.search(k) and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 100:
                ids.add(v)
    return frozenset(ids)


class Data:
    """Image-dependent data for one model: patterns per class, captions per class."""

    def __init__(self, seed: int = 0, avoid: frozenset[int] = frozenset()) -> None:
        g = torch.Generator().manual_seed(20_000 + seed)
        words = torch.tensor([i for i in range(100 + len(avoid)) if i not in avoid])[:100]  # no special token
        self.captions = words[torch.randint(0, 100, (CLASSES, CAPTION), generator=g)]
        self.seed = seed
        self._patterns: dict[tuple, torch.Tensor] = {}

    def patterns(self, shape: tuple) -> torch.Tensor:
        if shape not in self._patterns:
            g = torch.Generator().manual_seed(10_000 + self.seed)
            self._patterns[shape] = torch.rand(CLASSES, *shape, generator=g)
        return self._patterns[shape]

    def draw(self, shape: tuple, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        cls = torch.randint(0, CLASSES, (BATCH,), generator=g)
        return cls, self.patterns(shape)[cls] + 0.1 * torch.randn(BATCH, *shape, generator=g)


def _params(model: torch.nn.Module) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def _vision_inputs(model: torch.nn.Module, cfg: Any, fmt: str) -> Callable[[torch.Tensor], dict[str, Any]] | None:
    """The pixel inputs of one layout, from a (B, ...) sample of class patterns."""
    vc = getattr(cfg, "vision_config", None) or getattr(getattr(cfg, "thinker_config", None), "vision_config", None)
    patch = getattr(vc, "patch_size", PATCH)
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    temporal = getattr(vc, "temporal_patch_size", 1) or 1
    channels = getattr(vc, "in_channels", None) or getattr(vc, "num_channels", 3) or 3
    if fmt == "pixels":
        return lambda x: {"pixel_values": x}
    if fmt == "pixels5d":
        return lambda x: {"pixel_values": x.unsqueeze(1)}
    if fmt == "tiles":  # LLaVA-NeXT's base image and one tile (a grid of one pinpoint)
        return lambda x: {"pixel_values": torch.stack([x, x.flip(-1)], dim=1)}
    if fmt == "flattened":  # Pix2Struct: (row, column) and the patch's pixels, per patch
        width = getattr(vc, "patch_embed_hidden_size", 3 * patch * patch) + 2
        rows = (IMAGE // patch) ** 2

        def flattened(x: torch.Tensor) -> dict[str, Any]:
            flat = x.reshape(BATCH, -1)[:, : rows * width]
            flat = torch.nn.functional.pad(flat, (0, rows * width - flat.shape[1])).reshape(BATCH, rows, width)
            return {"flattened_patches": flat, "attention_mask": torch.ones(BATCH, rows, dtype=torch.long)}

        return flattened
    if fmt == "patches":
        grid = IMAGE // patch
        thw = torch.tensor([[1, grid, grid]] * BATCH)
        width = channels * temporal * patch * patch

        def patches(x: torch.Tensor) -> dict[str, Any]:
            # each image's patches (grid*grid, width): the class pattern laid out as patches
            flat = x.reshape(BATCH, -1)[:, : grid * grid * width]
            flat = torch.nn.functional.pad(flat, (0, grid * grid * width - flat.shape[1]))
            return {"pixel_values": flat.reshape(BATCH * grid * grid, width), "image_grid_thw": thw}

        return patches
    return None


def _extras(model: torch.nn.Module, ids: torch.Tensor, token: int | None) -> dict[str, Any]:
    params, out = _params(model), {}
    token = -1 if token is None else token
    if "attention_mask" in params:
        out["attention_mask"] = torch.ones_like(ids)
    if "image_sizes" in params:
        out["image_sizes"] = torch.tensor([[IMAGE, IMAGE]] * BATCH)
    if "token_type_ids" in params:
        out["token_type_ids"] = (ids == token).long()
    if "mm_token_type_ids" in params:
        out["mm_token_type_ids"] = (ids == token).int()
    if "qformer_input_ids" in params:  # InstructBLIP's instruction to its Q-Former
        out["qformer_input_ids"] = torch.arange(5).repeat(BATCH, 1)
        out["qformer_attention_mask"] = torch.ones(BATCH, 5, dtype=torch.long)
    return out


def _ids(data: Data, cls: torch.Tensor, tokens: int, token: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([torch.full((BATCH, tokens), token), data.captions[cls]], dim=1)
    return ids, ids.masked_fill(ids == token, -100)


FEATURES = re.compile(r"features:?\s*\[?\s*(\d+)")


def _features(e: Exception) -> int | None:
    """The feature count a "features and tokens do not match" error names (all samples)."""
    m = FEATURES.search(str(e))
    return int(m.group(1)) if m is not None and "match" in str(e) else None


def _rows(model: torch.nn.Module, modality: str) -> tuple[list[int], Callable[[], None]]:
    """A hook on the module whose output fills the placeholders (the aligner, else the encoder MPU):
    the feature rows per sample it made at the last forward, read from its output's shape."""
    from mscale.hook.core.mpu import MpuLayoutError, discover
    from mscale.hook.core.outputs import output_tensors

    seen: list[int] = []
    try:
        mpus = {m.name: m.module for m in discover(model)}
    except MpuLayoutError:
        return seen, lambda: None
    module = mpus.get("aligner") or mpus.get(modality)
    if module is None:
        return seen, lambda: None

    def hook(mod: Any, args: Any, out: Any) -> None:
        t = next((x for x in output_tensors(out) if x.dim() >= 2), None)
        if t is not None:
            seen[:] = [t.shape[1]] if t.dim() == 3 else [t.shape[0] // BATCH] if t.shape[0] % BATCH == 0 else []

    return seen, module.register_forward_hook(hook).remove


def _probe(
    model: torch.nn.Module, make: Callable[[int], dict[str, Any]], first: int = 1, modality: str = "vision"
) -> tuple[int, str]:
    """(placeholders per sample, "") once a forward runs with a finite loss; (-1, the last error)
    when none does. The count is the model's: its error names the features (rows, or elements of
    HIDDEN-wide rows, divided over the batch), and the module that fills the placeholders made
    them (its output's rows per sample)."""
    queue, tried, err = [first], set(), ""
    seen, remove = _rows(model, modality)
    try:
        while queue and len(tried) < 6:
            tokens = queue.pop(0)
            if tokens in tried:
                continue
            tried.add(tokens)
            n, out, err = _forward(model, make, tokens)
            if out is None:
                if n is not None:
                    queue += [n // d for d in (BATCH, BATCH * HIDDEN) if n % d == 0 and n >= d]
                queue += seen
                continue
            loss = getattr(out, "loss", None)
            if isinstance(loss, torch.Tensor) and torch.isfinite(loss):
                return tokens, ""
            err = "the forward returned no finite loss"
    finally:
        remove()
    return -1, err


def _forward(model: torch.nn.Module, make: Callable[[int], dict[str, Any]], tokens: int) -> tuple[int | None, Any, str]:
    """(the feature count its error names, the output or None, the error)."""
    try:
        with torch.no_grad():
            return None, model(**make(tokens)), ""
    except Exception as e:  # the model's own error says the count, or why the layout is wrong
        return _features(e), None, f"{type(e).__name__}: {str(e)[:200]}"


def vision_batches(model: torch.nn.Module, cfg: Any, data: Data, token: int | None) -> tuple[Callable, str]:
    """Tries each pixel layout; with no placeholder token (an encoder-decoder, BLIP, GIT: the image
    reaches the text by cross-attention or as a prefix) the captions alone are the text."""
    params = _params(model)
    if "flattened_patches" in params:
        order = ["flattened"]
    elif "image_grid_thw" in params:
        order = ["patches", "pixels", "pixels5d"]
    else:
        order = ["pixels", "pixels5d", "tiles", "patches"]
    errors = []
    for fmt in order:
        inputs = _vision_inputs(model, cfg, fmt)
        assert inputs is not None
        fixed = data.draw((3, IMAGE, IMAGE), torch.Generator().manual_seed(0))[0]

        def make(tokens: int, cls: torch.Tensor = fixed, g: torch.Generator | None = None, inputs=inputs) -> dict:
            if g is not None:
                cls, x = data.draw((3, IMAGE, IMAGE), g)
            else:
                x = data.patterns((3, IMAGE, IMAGE))[cls]
            ids, labels = _ids(data, cls, tokens, token if token is not None else -1)
            batch = {"input_ids": ids, "labels": labels, **_extras(model, ids, token), **inputs(x)}
            if "high_res_pixel_values" in params:  # DeepSeek-VL hybrid: the same image at its high-res tower
                batch["high_res_pixel_values"] = batch["pixel_values"]
            if "input_ids" not in params:
                del batch["input_ids"]  # an encoder-decoder's decoder inputs come from the labels
            return batch

        tokens, err = _probe(model, make, first=1 if token is not None else 0)
        if tokens >= 0:
            what = f"{tokens} image tokens" if token is not None else "no placeholders"
            return (lambda step, g, make=make, tokens=tokens: make(tokens, g=g)), f"{fmt}, {what}"
        errors.append(f"{fmt}: {err}")
    raise RuntimeError("no input layout ran: " + "; ".join(errors))


def audio_batches(model: torch.nn.Module, cfg: Any, data: Data, token: int | None) -> tuple[Callable, str]:
    ac = next((c for c in _configs(cfg)[1:] if "audio" in type(c).__name__.lower() or hasattr(c, "num_mel_bins")), None)
    ac = ac or getattr(cfg, "encoder_config", None)  # Granite-Speech's CTC encoder
    mels = next(
        (getattr(ac, k) for k in ("num_mel_bins", "input_dim", "n_mels", "feature_size") if getattr(ac, k, None)), MELS
    )
    frames = 2 * getattr(ac, "n_window", 0) or 2 * (getattr(ac, "max_source_positions", 0) or FRAMES // 2)
    params = _params(model)
    mask_key = next((k for k in ("feature_attention_mask", "input_features_mask") if k in params), None)

    errors = []
    for shape in ((mels, frames), (frames, mels)):  # (B, mels, frames), or frames first (a CTC encoder's)

        def make(tokens: int, g: torch.Generator | None = None, shape: tuple = shape) -> dict:
            cls, x = data.draw(shape, g if g is not None else torch.Generator().manual_seed(0))
            ids, labels = _ids(data, cls, tokens, token if token is not None else -1)
            batch = {"input_ids": ids, "labels": labels, "input_features": x, **_extras(model, ids, token)}
            if mask_key:
                batch[mask_key] = torch.ones(BATCH, frames, dtype=torch.long)
            return batch

        tokens, err = _probe(model, make, modality="audio")
        if tokens >= 0:
            return (
                lambda step, g, make=make, tokens=tokens: make(tokens, g=g)
            ), f"log-mel {shape[0]}x{shape[1]}, {tokens} audio tokens"
        errors.append(f"{shape[0]}x{shape[1]}: {err}")
    raise RuntimeError("log-mel features " + "; ".join(errors))


def _hand_built(family: str) -> Callable[[], tuple[Any, Callable]] | None:
    """The tests' own tiny builders, where a family has one."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from support import tiny_families as tf
    from support import tiny_hf

    return {
        "llava": lambda: tiny_hf.tiny_llava(seed=0),
        "qwen2_vl": lambda: tiny_hf.tiny_qwen2vl(seed=0, normalize=True),
        "idefics3": lambda: tf.idefics3(seed=0),
        "smolvlm": lambda: tf.idefics3(seed=0, smol=True),
        "blip-2": lambda: tf.blip2(seed=0),
        "instructblip": lambda: tf.instructblip(seed=0),
        "paligemma": lambda: tf.paligemma(seed=0),
        "gemma3": lambda: tf.gemma3(seed=0),
        "mistral3": lambda: tf.mistral3(seed=0),
        "aya_vision": lambda: tf.aya_vision(seed=0),
        "internvl": lambda: tf.internvl(seed=0),
        "llava_next": lambda: tf.llava_next(seed=0),
        "idefics2": lambda: tf.idefics2(seed=0),
        "qwen2_audio": lambda: tf.qwen2_audio(seed=0),
    }.get(family)


def tiny(family: str, modality: str = "vision", seed: int = 0) -> tuple[torch.nn.Module, Callable, str]:
    """(model, make_batch(step, generator), how it was built). Raises with the stage that failed."""
    hand = _hand_built(family)
    if hand is not None:
        model, make_batch = hand()
        return model, make_batch, "the tests' tiny builder"
    try:
        cfg = tiny_config(family)
    except Exception as e:
        raise RuntimeError(f"tiny config: {type(e).__name__}: {str(e)[:200]}") from None
    torch.manual_seed(seed)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = getattr(T, families()[family])(cfg)
    except Exception as e:
        raise RuntimeError(f"build: {type(e).__name__}: {str(e)[:200]}") from None
    model.train()
    token = placeholder(cfg, modality)
    if token is None and modality == "audio":
        raise RuntimeError("batch: no audio token id in the config")
    maker = audio_batches if modality == "audio" else vision_batches
    try:
        make_batch, how = maker(model, cfg, Data(seed, special(cfg)), token)
    except RuntimeError as e:
        raise RuntimeError(f"batch: {e}") from None
    return model, make_batch, how
