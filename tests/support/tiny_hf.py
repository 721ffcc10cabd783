"""Tiny Hugging Face multimodal models built offline (random weights, nothing downloaded) and
image-dependent training data for them: the caption tokens are a function of the image, so the
loss can only fall if the vision path carries the image (a broken vision tower shows in the loss).

    model, make_batch = tiny_llava(seed=0)
    batch = make_batch(step, torch.Generator().manual_seed(step))
    loss = model(**batch).loss

Both models are small enough to train a few hundred steps on one CPU core in seconds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

BATCH = 4
CLASSES = 8  # image classes; each has its own pattern and its own caption
CAPTION = 6  # caption tokens after the image
VOCAB = 128

LLAVA_IMAGE = 16  # pixels (CLIP's fixed input size)
LLAVA_PATCH = 4
LLAVA_IMAGE_TOKEN = 127
LLAVA_IMAGE_TOKENS = (LLAVA_IMAGE // LLAVA_PATCH) ** 2  # "default" strategy: CLS dropped

QWEN_IMAGE = 16  # pixels (dynamic resolution: any multiple of patch * merge)
QWEN_PATCH = 2
QWEN_MERGE = 2
QWEN_TEMPORAL = 2
QWEN_IMAGE_TOKEN = 127
QWEN_VISION_START = 125
QWEN_VISION_END = 126
QWEN_VIDEO_TOKEN = 124
# Qwen2-VL's image processor normalizes pixels with CLIP's mean and std (values about -1.8..2.1)
QWEN_MEAN = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
QWEN_STD = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)

Batch = dict[str, torch.Tensor]
MakeBatch = Callable[[int, torch.Generator], Batch]


def _patterns(seed: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.rand(CLASSES, 3, size, size, generator=g)


def _captions(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(20_000 + seed)
    return torch.randint(0, 100, (CLASSES, CAPTION), generator=g)


def _images(patterns: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    cls = torch.randint(0, CLASSES, (BATCH,), generator=g)
    noise = 0.1 * torch.randn(BATCH, *patterns.shape[1:], generator=g)
    return cls, patterns[cls] + noise


def tiny_llava(
    seed: int = 0, image: int = LLAVA_IMAGE, endings: int = 1
) -> tuple[LlavaForConditionalGeneration, MakeBatch]:
    """LLaVA: a CLIP vision tower with a fixed `image` x `image` input (16: a 4x4 patch grid),
    the projector, a Llama text model. `endings` > 1: each caption's last token is one of
    `endings` per class, drawn at random per sample, so the task loss has a floor above zero
    (ln(endings) / CAPTION) as real captions do, and a trained model's final loss is a plateau
    rather than a number falling toward 0 as the logits grow."""
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=image,
        patch_size=LLAVA_PATCH,
        projection_dim=32,
    )
    text = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=max(64, (image // LLAVA_PATCH) ** 2 + CAPTION + 8),
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=LLAVA_IMAGE_TOKEN,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    model = LlavaForConditionalGeneration(cfg)
    patterns, captions = _patterns(seed, image), _captions(seed)
    last = _last_tokens(seed, endings)
    tokens = (image // LLAVA_PATCH) ** 2

    def make_batch(step: int, g: torch.Generator) -> Batch:
        cls, pixels = _images(patterns, g)
        image = torch.full((BATCH, tokens), LLAVA_IMAGE_TOKEN)
        caption = captions[cls]
        if endings > 1:  # drawn after the images: endings=1 draws exactly what it always did
            caption = _with_endings(caption, cls, last, g)
        ids = torch.cat([image, caption], dim=1)
        return {"input_ids": ids, "pixel_values": pixels, "labels": ids.masked_fill(ids == LLAVA_IMAGE_TOKEN, -100)}

    return model, make_batch


class Samples(torch.utils.data.Dataset):
    """A tiny model's batches as a dataset of `size` samples: sample i is the first of the
    batch `make_batch` draws from a generator seeded with i (the same for every run)."""

    def __init__(self, make_batch: MakeBatch, size: int) -> None:
        self.make_batch, self.size = make_batch, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Batch:
        return {k: v[0] for k, v in self.make_batch(i, torch.Generator().manual_seed(i)).items()}


def qwen2vl_patches(images: torch.Tensor, patch: int = QWEN_PATCH, merge: int = QWEN_MERGE) -> torch.Tensor:
    """Images (n, 3, H, W) as Qwen2-VL's flattened patches, in its image processor's order (one
    frame repeated over the temporal patch; patches grouped by merge window)."""
    n, c, h, w = images.shape
    gh, gw = h // patch, w // patch
    x = images.unsqueeze(1).expand(n, QWEN_TEMPORAL, c, h, w)
    x = x.reshape(n, QWEN_TEMPORAL, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(n * gh * gw, c * QWEN_TEMPORAL * patch * patch)


def _last_tokens(seed: int, endings: int) -> torch.Tensor:
    return torch.randint(0, 100, (CLASSES, endings), generator=torch.Generator().manual_seed(30_000 + seed))


def _with_endings(caption: torch.Tensor, cls: torch.Tensor, last: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Each caption's last token one of `last`'s endings for its class, drawn per sample."""
    caption = caption.clone()
    caption[:, -1] = last[cls, torch.randint(0, last.shape[1], (BATCH,), generator=g)]
    return caption


def tiny_qwen2vl(
    seed: int = 0, endings: int = 1, normalize: bool = False
) -> tuple[Qwen2VLForConditionalGeneration, MakeBatch]:
    """Qwen2-VL: a dynamic-resolution vision tower (patches + grid_thw, 2x2 merger inside it),
    a Qwen2 text model with multimodal rotary positions. `normalize`: pixels as its image
    processor gives them (CLIP mean and std); raw 0..1 pixels differ too little between classes
    for the tiny tower, which then never learns to read them (it sits at the image-blind loss
    after 2000 steps, where normalized ones are read within 200). `endings` as in `tiny_llava`."""
    torch.manual_seed(seed)
    cfg = Qwen2VLConfig(
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 32,
            "num_heads": 4,
            "mlp_ratio": 2,
            "patch_size": QWEN_PATCH,
            "spatial_merge_size": QWEN_MERGE,
            "temporal_patch_size": QWEN_TEMPORAL,
        },
        text_config={
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "max_position_embeddings": 128,
            "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0},
            "bos_token_id": 0,
            "eos_token_id": 1,
        },
        image_token_id=QWEN_IMAGE_TOKEN,
        video_token_id=QWEN_VIDEO_TOKEN,
        vision_start_token_id=QWEN_VISION_START,
        vision_end_token_id=QWEN_VISION_END,
    )
    model = Qwen2VLForConditionalGeneration(cfg)
    patterns, captions = _patterns(seed, QWEN_IMAGE), _captions(seed)
    grid = QWEN_IMAGE // QWEN_PATCH
    tokens = grid * grid // QWEN_MERGE**2
    last = _last_tokens(seed, endings)

    def make_batch(step: int, g: torch.Generator) -> Batch:
        cls, pixels = _images(patterns, g)
        if normalize:
            pixels = (pixels - QWEN_MEAN) / QWEN_STD
        caption = captions[cls]
        if endings > 1:  # drawn after the images: endings=1 draws exactly what it always did
            caption = _with_endings(caption, cls, last, g)
        start = torch.full((BATCH, 1), QWEN_VISION_START)
        image = torch.full((BATCH, tokens), QWEN_IMAGE_TOKEN)
        end = torch.full((BATCH, 1), QWEN_VISION_END)
        ids = torch.cat([start, image, end, caption], dim=1)
        labels = ids.clone()
        labels[:, : tokens + 2] = -100
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": (ids == QWEN_IMAGE_TOKEN).int(),  # text 0, image 1 (M-RoPE positions)
            "pixel_values": qwen2vl_patches(pixels),
            "image_grid_thw": torch.tensor([[1, grid, grid]] * BATCH),
            "labels": labels,
        }

    return model, make_batch


def guarded(job_id: str, *, healing: object, memory_every: int = 1, qwen: bool = False) -> tuple:
    """A tiny LLaVA (or Qwen2-VL) under the README's line, in-memory snapshots every
    `memory_every` steps, `healing` its HealingSection, with every finding kept:
    (model, make_batch, optimizer, guard, findings)."""
    import mscale

    model, make_batch = (tiny_qwen2vl if qwen else tiny_llava)(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    findings: list = []

    class Keep:
        def on_finding(self, f: object) -> None:
            findings.append(f)

    guard = mscale.attach(
        model,
        opt,
        job_id=job_id,
        connect=False,
        plugins=[Keep()],
        snapshots=mscale.SnapshotConfig(memory_every=memory_every),
        healing=healing,
    )
    return model, make_batch, opt, guard, findings
