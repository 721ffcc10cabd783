"""The module names by which discovery (mscale.hook.mpu) knows each model family's MPUs: data,
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
