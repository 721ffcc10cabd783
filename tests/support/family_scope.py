"""Which installed multimodal families the guard covers, and why not the others: read by
tests/test_families.py (its discovery test on the meta device) and scripts/families_sweep.py.

OUT_OF_SCOPE: families with no vision or audio tower at all (images or audio enter as discrete
tokens, or through one linear, or there is no image or audio): nothing for the fuse to guard
beyond the text model. GAPS: families with a tower that the discovery does not find with a text
model, or whose default config does not build (transformers 5.24 as installed here); each may be
mapped by hand (`mpus=`)."""

from __future__ import annotations

OUT_OF_SCOPE = {
    "apertus1p5": "images and audio enter as discrete tokens (a VQ image tokenizer, WavTokenizer): no tower",
    "chameleon": "images enter as discrete tokens (its VQ-VAE `vqmodel`): no tower",
    "emu3": "images enter as discrete tokens (its VQ-VAE `vqmodel`): no tower",
    "evolla": "protein sequences and text: no image or audio",
    "fuyu": "no separate tower: image patches enter the decoder through one linear, `vision_embed_tokens`",
    "kyutai_speech_to_text": "audio enters as discrete Mimi codec tokens (`codec_model`): no tower",
    "mistral4": "a text-only causal LM listed in the multimodal mapping",
    "udop": "one joint encoder over text, layout and image patches (a conv patch embedding): no tower",
}

# discovery on the meta device from the default config: what it finds, or that the config does not build
GAPS = {
    "aya_vision": "does not build from its default config: ValueError",  # built tiny in the tests
    "cohere_compass": "does not build from its default config: KeyError",
    "deepseek_ocr2": "does not build from its default config: TypeError",
    "diffusion_gemma": "does not build from its default config: TypeError",
    "fast_vlm": "does not build from its default config: ImportError",  # timm is not installed
    "gemma3n": "does not build from its default config: ImportError",  # timm
    "gemma4": "discovery finds ['text']",  # its default config has no vision_config or audio_config
    "gemma4_unified": "discovery finds ['text']",  # the same
    "granite4_vision": "does not build from its default config: TypeError",
    "hunyuan_vl": "does not build from its default config: TypeError",
    # v1: the text model is IdeficsModel itself, which holds the vision tower, its decoder layers
    # and the gated cross-attention layers (ModuleLists its forward indexes): no text MPU beside it
    "idefics": "discovery finds ['vision']",
    "perception_lm": "does not build from its default config: ImportError",  # timm
    # both towers sit inside the text model's embedding (embed_tokens_extend): no text MPU beside them
    "phi4_multimodal": "discovery finds ['audio', 'vision']",
    "qwen3_omni_moe": "does not build from its default config: AttributeError",
    "qwen4_exp": "does not build from its default config: TypeError",
    # two audio encoders side by side (acoustic and semantic); discovery makes one audio MPU a model
    "vibevoice_asr": "discovery finds ['aligner', 'text']",
}
