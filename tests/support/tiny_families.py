"""Tiny Hugging Face vision-language models of the families the MPU discovery knows beyond
LLaVA and Qwen2-VL (tests/support/tiny_hf.py), built offline from configs, each with a batch
maker whose captions depend on the image (as tiny_hf's)."""

from __future__ import annotations

import torch
import transformers as T

from support.tiny_hf import BATCH, CLASSES, VOCAB, _captions, _images, _patterns

IMAGE, PATCH, IMAGE_TOKEN = 16, 4, 127
TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=VOCAB,
    max_position_embeddings=256,
)
VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE, patch_size=PATCH
)


def _ids(tokens: int, caption: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.cat([torch.full((BATCH, tokens), IMAGE_TOKEN), caption], dim=1)
    return ids, ids.masked_fill(ids == IMAGE_TOKEN, -100)


def idefics3(seed: int = 0, smol: bool = False):
    torch.manual_seed(seed)
    config = T.SmolVLMConfig if smol else T.Idefics3Config
    model_class = T.SmolVLMForConditionalGeneration if smol else T.Idefics3ForConditionalGeneration
    cfg = config(
        vision_config=VISION, text_config=dict(model_type="llama", **TEXT), image_token_id=IMAGE_TOKEN, scale_factor=2
    )
    model = model_class(cfg)
    patterns, captions = _patterns(seed, IMAGE), _captions(seed)
    tokens = (IMAGE // PATCH) ** 2 // 4

    def make_batch(step: int, g: torch.Generator) -> dict:
        cls, pixels = _images(patterns, g)
        ids, labels = _ids(tokens, captions[cls])
        return {"input_ids": ids, "pixel_values": pixels.unsqueeze(1), "labels": labels}

    return model, make_batch


def blip2(seed: int = 0):
    torch.manual_seed(seed)
    queries = 4
    cfg = T.Blip2Config(
        vision_config=VISION,
        qformer_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            encoder_hidden_size=32,
            vocab_size=VOCAB,
        ),
        text_config=dict(OPT),
        num_query_tokens=queries,
        image_token_index=IMAGE_TOKEN,
    )
    model = T.Blip2ForConditionalGeneration(cfg)
    patterns, captions = _patterns(seed, IMAGE), _captions(seed)

    def make_batch(step: int, g: torch.Generator) -> dict:
        cls, pixels = _images(patterns, g)
        ids, labels = _ids(queries, captions[cls])
        return {"input_ids": ids, "pixel_values": pixels, "labels": labels}

    return model, make_batch


# -- the families below share one recipe: a config of tiny towers, a model built from it, and
# batches of `tokens` image (or audio) placeholders before the image's caption

OPT = dict(
    model_type="opt",
    hidden_size=32,
    ffn_dim=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    vocab_size=VOCAB,
    word_embed_proj_dim=32,
    max_position_embeddings=256,
)
SIGLIP = dict(model_type="siglip_vision_model", **VISION)
MERGED = (IMAGE // PATCH // 2) ** 2  # image tokens after a 2x2 merge of the 4x4 patch grid


def _vision_family(model, tokens: int, seed: int, extra=lambda ids, pixels: {}, pixels_shape=None):
    patterns, captions = _patterns(seed, IMAGE), _captions(seed)

    def make_batch(step: int, g: torch.Generator) -> dict:
        cls, pixels = _images(patterns, g)
        ids, labels = _ids(tokens, captions[cls])
        shaped = pixels_shape(pixels) if pixels_shape is not None else pixels
        return {"input_ids": ids, "pixel_values": shaped, "labels": labels, **extra(ids, pixels)}

    return model, make_batch


def _built(config_class, model_class, seed: int, **cfg):
    torch.manual_seed(seed)
    return model_class(config_class(**cfg))


def paligemma(seed: int = 0):
    model = _built(
        T.PaliGemmaConfig,
        T.PaliGemmaForConditionalGeneration,
        seed,
        vision_config=SIGLIP,
        text_config=dict(model_type="gemma", head_dim=8, **TEXT),
        image_token_index=IMAGE_TOKEN,
        projection_dim=32,
    )
    return _vision_family(model, (IMAGE // PATCH) ** 2, seed)


def gemma3(seed: int = 0):
    model = _built(
        T.Gemma3Config,
        T.Gemma3ForConditionalGeneration,
        seed,
        vision_config=SIGLIP,
        text_config=dict(model_type="gemma3_text", head_dim=8, **TEXT),
        image_token_index=IMAGE_TOKEN,
        mm_tokens_per_image=MERGED,
        boi_token_index=125,
        eoi_token_index=126,
    )
    return _vision_family(model, MERGED, seed, extra=lambda ids, _: {"token_type_ids": (ids == IMAGE_TOKEN).long()})


def mistral3(seed: int = 0):
    pixtral = dict(model_type="pixtral", head_dim=8, **{k: v for k, v in VISION.items()})
    model = _built(
        T.Mistral3Config,
        T.Mistral3ForConditionalGeneration,
        seed,
        vision_config=pixtral,
        text_config=dict(model_type="mistral", head_dim=8, **TEXT),
        image_token_index=IMAGE_TOKEN,
        spatial_merge_size=2,
    )
    sizes = torch.tensor([[IMAGE, IMAGE]] * BATCH)
    return _vision_family(model, MERGED, seed, extra=lambda ids, _: {"image_sizes": sizes})


def aya_vision(seed: int = 0):
    model = _built(
        T.AyaVisionConfig,
        T.AyaVisionForConditionalGeneration,
        seed,
        vision_config=SIGLIP,
        text_config=dict(model_type="cohere2", head_dim=8, **TEXT, eos_token_id=VOCAB - 1),
        image_token_index=IMAGE_TOKEN,
        downsample_factor=2,
    )
    return _vision_family(model, MERGED, seed)


def internvl(seed: int = 0):
    vision = dict(VISION, image_size=[IMAGE, IMAGE], patch_size=[PATCH, PATCH])
    model = _built(
        T.InternVLConfig,
        T.InternVLForConditionalGeneration,
        seed,
        vision_config=vision,
        text_config=dict(model_type="qwen2", **TEXT),
        image_token_id=IMAGE_TOKEN,
        downsample_ratio=0.5,
    )
    return _vision_family(model, MERGED, seed)


def llava_next(seed: int = 0):
    """One tile besides the base image (a grid of one pinpoint): 16 + 16 patch features and the
    row-end newlines, 36 image tokens."""
    model = _built(
        T.LlavaNextConfig,
        T.LlavaNextForConditionalGeneration,
        seed,
        vision_config=dict(model_type="clip_vision_model", projection_dim=32, **VISION),
        text_config=dict(model_type="llama", **TEXT),
        image_token_index=IMAGE_TOKEN,
        image_grid_pinpoints=[[IMAGE, IMAGE]],
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    sizes = torch.tensor([[IMAGE, IMAGE]] * BATCH)
    tiles = lambda pixels: torch.stack([pixels, pixels.flip(-1)], dim=1)  # noqa: E731 (the base and one tile)
    return _vision_family(model, 36, seed, extra=lambda ids, _: {"image_sizes": sizes}, pixels_shape=tiles)


def idefics2(seed: int = 0):
    model = _built(
        T.Idefics2Config,
        T.Idefics2ForConditionalGeneration,
        seed,
        vision_config=dict(VISION),
        perceiver_config=dict(
            hidden_size=32, resampler_n_latents=4, resampler_depth=1, resampler_n_heads=4, resampler_head_dim=8
        )
        | {"num_key_value_heads": 4},
        text_config=dict(model_type="mistral", head_dim=8, **TEXT),
        image_token_id=IMAGE_TOKEN,
    )
    return _vision_family(model, 4, seed, pixels_shape=lambda pixels: pixels.unsqueeze(1))


def instructblip(seed: int = 0):
    model = _built(
        T.InstructBlipConfig,
        T.InstructBlipForConditionalGeneration,
        seed,
        vision_config=dict(VISION),
        qformer_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            encoder_hidden_size=32,
            vocab_size=VOCAB,
        ),
        text_config=OPT,
        num_query_tokens=4,
        image_token_index=IMAGE_TOKEN,
    )
    prompt = torch.arange(5).repeat(BATCH, 1)  # the Q-Former's instruction
    return _vision_family(
        model,
        4,
        seed,
        extra=lambda ids, _: {"qformer_input_ids": prompt, "qformer_attention_mask": torch.ones_like(prompt)},
    )


MELS, FRAMES = 16, 32  # log-mel bins and frames per clip (the encoder's 2 x max_source_positions)
AUDIO_TOKENS = ((FRAMES - 1) // 2 + 1 - 2) // 2 + 1  # after the encoder's stride-2 conv and its pooling


def qwen2_audio(seed: int = 0):
    """Qwen2-Audio: a Whisper-style audio encoder (`audio_tower`), the projector, a Qwen2 text
    model; each class of clip has its own log-mel pattern and caption."""
    model = _built(
        T.Qwen2AudioConfig,
        T.Qwen2AudioForConditionalGeneration,
        seed,
        audio_config=dict(
            model_type="qwen2_audio_encoder",
            d_model=32,
            encoder_layers=2,
            encoder_attention_heads=4,
            encoder_ffn_dim=64,
            num_mel_bins=MELS,
            max_source_positions=FRAMES // 2,
        ),
        text_config=dict(model_type="qwen2", **TEXT),
        audio_token_index=IMAGE_TOKEN,
    )
    g0 = torch.Generator().manual_seed(10_000 + seed)
    patterns, captions = torch.rand(CLASSES, MELS, FRAMES, generator=g0), _captions(seed)
    mask = torch.ones(BATCH, FRAMES, dtype=torch.long)

    def make_batch(step: int, g: torch.Generator) -> dict:
        cls = torch.randint(0, CLASSES, (BATCH,), generator=g)
        clips = patterns[cls] + 0.1 * torch.randn(BATCH, MELS, FRAMES, generator=g)
        ids, labels = _ids(AUDIO_TOKENS, captions[cls])
        return {"input_ids": ids, "input_features": clips, "feature_attention_mask": mask, "labels": labels}

    return model, make_batch


def _caption_family(model, seed: int, ids: bool = True):
    """Batches of images and their captions with no image placeholders: the captions are the
    text model's input (`ids`) and its labels."""
    patterns, captions = _patterns(seed, IMAGE), _captions(seed)

    def make_batch(step: int, g: torch.Generator) -> dict:
        cls, pixels = _images(patterns, g)
        text = {"input_ids": captions[cls]} if ids else {}
        return {"pixel_values": pixels, "labels": captions[cls], **text}

    return model, make_batch


def blip(seed: int = 0):
    """BLIP: a ViT and a BERT decoder that reads the ViT's last_hidden_state by cross-attention."""
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB)
    model = _built(
        T.BlipConfig,
        T.BlipForConditionalGeneration,
        seed,
        vision_config=dict(VISION),
        text_config=dict(text, encoder_hidden_size=32),
        projection_dim=32,
    )
    return _caption_family(model, seed)


def git(seed: int = 0):
    """GIT: a CLIP-style tower, its projection, and a BERT-style decoder over the projected image
    (a prefix, no placeholders) and the caption."""
    model = _built(
        T.GitConfig,
        T.GitForCausalLM,
        seed,
        vision_config=dict(VISION),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=VOCAB,
    )
    return _caption_family(model, seed)


def vision_encoder_decoder(seed: int = 0):
    """A VisionEncoderDecoder: a ViT encoder and a BERT decoder that reads it by cross-attention;
    no image placeholders, the captions are the decoder's labels."""
    encoder = T.ViTConfig(**{k: v for k, v in VISION.items()}, num_channels=3)
    decoder = T.BertConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=VOCAB,
        is_decoder=True,
        add_cross_attention=True,
    )
    cfg = T.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    cfg.decoder_start_token_id, cfg.pad_token_id = 1, 0
    model = _built(lambda **c: cfg, T.VisionEncoderDecoderModel, seed)
    patterns, captions = _patterns(seed, IMAGE), _captions(seed)

    def make_batch(step: int, g: torch.Generator) -> dict:
        cls, pixels = _images(patterns, g)
        return {"pixel_values": pixels, "labels": captions[cls]}

    return model, make_batch
