"""The module names by which discovery (mscale.hook.core.mpu) knows each model family's MPUs: data,
torch-free, one place to add a family's layout."""

from __future__ import annotations

# attribute name in the module tree -> MPU name. First match per MPU name wins (shallowest).
KNOWN_NAMES: dict[str, str] = {
    "vision_tower": "vision",
    "visual": "vision",
    "vision_model": "vision",
    "image_tower": "vision",  # Video-LLaVA (its video_tower is not found: one vision MPU a model)
    "vision_encoder": "vision",  # LightOnOCR
    "audio_tower": "audio",
    "qformer": "resampler",  # Blip2, InstructBlip: learned queries read the vision features
    "multi_modal_projector": "aligner",
    "mm_projector": "aligner",
    "mlp1": "aligner",
    "connector": "aligner",  # Idefics3, SmolVLM
    "language_projection": "aligner",  # Blip2: the Q-Former's output into the text model's width
    "vision_projection": "aligner",  # LightOnOCR
    "language_model": "text",
    "text_model": "text",  # Idefics3, SmolVLM
    "text_decoder": "text",  # BLIP
}
# generic attribute names (`encoder`, `decoder`, `projector`) that name an MPU only under a parent
# of one of these classes: parent class name -> {attribute: MPU name}. Checked before KNOWN_NAMES.
KNOWN_CHILDREN: dict[str, dict[str, str]] = {
    # encoder-decoders: the image reaches the text decoder through its cross-attention
    "VisionEncoderDecoderModel": {"encoder": "vision", "decoder": "text"},
    "Pix2StructForConditionalGeneration": {"encoder": "vision", "decoder": "text"},
    "PPFormulaNetModel": {"encoder": "vision", "decoder": "text"},  # its projector sits in the encoder
    # GIT: a vision tower, its projection, and a BERT-style decoder (`encoder`) over image + text tokens
    "GitModel": {"image_encoder": "vision", "visual_projection": "aligner", "encoder": "text"},
    # Granite-Speech: a CTC speech encoder, a Q-Former projector (the qformer and its linear)
    "GraniteSpeechModel": {"encoder": "audio", "projector": "aligner"},
    "GraniteSpeechPlusModel": {"encoder": "audio", "projector": "aligner"},
    # Phi-4-multimodal: both towers inside the text model's embedding (no text MPU: it holds them)
    "Phi4MultimodalFeatureEmbedding": {"image_embed": "vision", "audio_embed": "audio"},
}

# the config keys of the token ids whose positions a tower's features fill (L3 places its student
# there: mscale.hook.fuse.distill), per modality, as the installed transformers families name them
# (`image_token_id` or `_index`, Video-LLaVA's `video_token_index`, Qwen2-VL's `video_token_id`,
# Qwen2-Audio's `audio_token_index`, ...)
PLACEHOLDER_KEYS: dict[str, tuple[str, ...]] = {
    "image": ("image_token_id", "image_token_index"),
    "video": ("video_token_id", "video_token_index"),
    "audio": ("audio_token_id", "audio_token_index"),
}


def placeholder_ids(cfg: object) -> dict[str, int]:
    """modality -> the placeholder token id a model's config (a transformers PretrainedConfig, read
    by attribute; None: none) gives for it."""
    found: dict[str, int] = {}
    for modality, keys in PLACEHOLDER_KEYS.items():
        v = next((v for k in keys if isinstance(v := getattr(cfg, k, None), int) and not isinstance(v, bool)), None)
        if v is not None:
            found[modality] = v
    return found


def placeholders(cfg: object, name: str, path: str = "") -> list[tuple[str, int]]:
    """(modality, token id) of every placeholder `cfg` names, the MPU's own modality first: the one
    its name or attribute says ("video", "audio", else images; a `video_tower` mapped as an MPU
    fills the video tokens, a Qwen2-VL tower either)."""
    words = f"{name} {path.rsplit('.', 1)[-1]}".lower()
    own = next((m for m in ("video", "audio") if m in words), "image")
    return sorted(placeholder_ids(cfg).items(), key=lambda kv: kv[0] != own)


def config_of(model: object, path: str) -> object:
    """The config of the model that holds the MPU at `path` (dotted, from `model`), whatever wraps
    it: the first on the way down whose config names a placeholder (a LightningModule's
    `self.model`, DDP's and FSDP1's `module`, compile's `_orig_mod`, Accelerate's DDP), else the
    first config on the way (an encoder-decoder's), else None."""
    first, m = None, model
    for part in [*(path.split(".") if path else []), None]:
        cfg = getattr(m, "config", None)
        if cfg is not None and placeholder_ids(cfg):
            return cfg
        first = cfg if first is None else first
        m = getattr(m, part, None) if part is not None else None
        if m is None:
            break
    return first
