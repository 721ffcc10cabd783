"""Tiny Hugging Face vision-language models of the families the MPU discovery knows beyond
LLaVA and Qwen2-VL (tests/support/tiny_hf.py), built offline from configs, each with a batch
maker whose captions depend on the image (as tiny_hf's)."""

from __future__ import annotations

import torch
import transformers as T

from support.tiny_hf import BATCH, VOCAB, _captions, _images, _patterns

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
        text_config=dict(
            model_type="opt",
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=VOCAB,
            word_embed_proj_dim=32,
            max_position_embeddings=256,
        ),
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
