"""A small multimodal model and a deterministic synthetic data set, for the demo, the
tests and the benchmarks: a ViT-like vision encoder, a projector (the aligner) and a tiny
causal text transformer, named the way Hugging Face LLaVA-style models name them
(`vision_tower`, `multi_modal_projector`, `language_model`) so MPU discovery finds them.

The task is learnable (each caption is a function of its image), so loss falls and a
fault-free reference run is meaningful. Everything is deterministic on CPU for a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class TinyConfig:
    image_size: int = 16
    patch: int = 4
    channels: int = 3
    vision_hidden: int = 32
    vision_layers: int = 2
    text_hidden: int = 32
    text_layers: int = 2
    heads: int = 4
    vocab: int = 64
    seq_len: int = 8
    ffn_mult: int = 2

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def patch_size(self) -> int:  # the name vision towers use (the fuse's L2 reads it)
        return self.patch


def _block(hidden: int, heads: int, ffn_mult: int) -> nn.TransformerEncoderLayer:
    # dropout 0: bitwise-reproducible training and replay checks compare exactly
    return nn.TransformerEncoderLayer(hidden, heads, hidden * ffn_mult, dropout=0.0, batch_first=True, norm_first=True)


class VisionTower(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Linear(cfg.channels * cfg.patch * cfg.patch, cfg.vision_hidden)
        self.pos = nn.Parameter(torch.zeros(1, cfg.patches, cfg.vision_hidden))
        self.layers = nn.ModuleList(
            _block(cfg.vision_hidden, cfg.heads, cfg.ffn_mult) for _ in range(cfg.vision_layers)
        )
        self.norm = nn.LayerNorm(cfg.vision_hidden)

    def forward(self, images: torch.Tensor, interpolate_pos_encoding: bool = False) -> torch.Tensor:
        """Any multiple of the patch size: the position table is interpolated when the patch
        count differs (as `interpolate_pos_encoding=True` asks of CLIP)."""
        b, c, h, w = images.shape
        p = self.cfg.patch
        x = images.unfold(2, p, p).unfold(3, p, p)  # B C H/p W/p p p
        x = x.permute(0, 2, 3, 1, 4, 5).reshape(b, (h // p) * (w // p), c * p * p)
        x = self.patch_embed(x)
        if x.shape[1] == self.pos.shape[1]:
            x = x + self.pos
        else:  # reduced-resolution input (L2 degradation): interpolate the position table
            pos = F.interpolate(self.pos.transpose(1, 2), size=x.shape[1], mode="linear", align_corners=False)
            x = x + pos.transpose(1, 2)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Projector(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(cfg.vision_hidden, cfg.text_hidden)
        self.act = nn.GELU()
        self.linear_2 = nn.Linear(cfg.text_hidden, cfg.text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LanguageModel(nn.Module):
    def __init__(self, cfg: TinyConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.text_hidden)
        self.pos = nn.Parameter(torch.zeros(1, cfg.patches + cfg.seq_len, cfg.text_hidden))
        self.layers = nn.ModuleList(_block(cfg.text_hidden, cfg.heads, cfg.ffn_mult) for _ in range(cfg.text_layers))
        self.norm = nn.LayerNorm(cfg.text_hidden)
        self.lm_head = nn.Linear(cfg.text_hidden, cfg.vocab)

    def forward(self, prefix: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logits over the text positions, final hidden states of all positions)."""
        x = torch.cat([prefix, self.embed(tokens)], dim=1)
        x = x + self.pos[:, : x.shape[1]]
        n = x.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        for layer in self.layers:
            x = layer(x, src_mask=mask)
        hidden = self.norm(x)
        return self.lm_head(hidden[:, prefix.shape[1] :]), hidden


class TinyMultimodal(nn.Module):
    """images (B,C,H,W) + tokens (B,T) -> next-token loss over the caption."""

    def __init__(self, cfg: TinyConfig = TinyConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_tower = VisionTower(cfg)
        self.multi_modal_projector = Projector(cfg)
        self.language_model = LanguageModel(cfg)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        feats = self.vision_tower(images)
        prefix = self.multi_modal_projector(feats)
        logits, hidden = self.language_model(prefix, tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits, "projected": prefix, "text_hidden": hidden}


class SyntheticCaptions(torch.utils.data.Dataset):
    """Sample i is a pure function of (seed, i): images, and a caption derived from them."""

    def __init__(self, cfg: TinyConfig = TinyConfig(), size: int = 4096, seed: int = 0) -> None:
        self.cfg, self.size, self.seed = cfg, size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.size:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        cfg = self.cfg
        image = torch.rand(cfg.channels, cfg.image_size, cfg.image_size, generator=g)
        # caption: quantised mean brightness of successive image rows, a learnable mapping
        rows = image.mean(dim=(0, 2))
        idx = torch.linspace(0, cfg.image_size - 1, cfg.seq_len + 1).long()
        tokens = (rows[idx] * (cfg.vocab - 1)).round().long().clamp(0, cfg.vocab - 1)
        return {"images": image, "tokens": tokens, "index": torch.tensor(i)}
