"""A two-MPU model with an AdamW optimizer and a disk snapshot engine, trained a few steps in
the test process: the snapshot tests that need a job and nothing more (fit, ownership)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from mscale.snapshot.config import SnapshotConfig
from mscale.snapshot.engine import SnapshotEngine


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision = nn.Linear(4, 3)
        self.text = nn.Linear(3, 2)
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.text(self.vision(x) * self.scale)


def job(directory: Path, dtype: torch.dtype = torch.float32, seed: int = 0, job_id: str = "", **settings):
    torch.manual_seed(seed)
    model = Net().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mpus = {"vision": ("001", model.vision), "text": ("002", model.text)}
    # the node tier (node_tier.py) only where a test asks for it: node_every=None is its default
    settings = {"memory_every": 0, "disk_every": 10, "node_every": 0, **settings}
    engine = SnapshotEngine(
        model, opt, config=SnapshotConfig(directory=directory, **settings), mpus=mpus, job_id=job_id
    )
    return model, opt, engine


def train(model: nn.Module, opt: torch.optim.Optimizer, engine: SnapshotEngine, first: int, last: int) -> None:
    dtype = next(model.parameters()).dtype
    for step in range(first, last + 1):
        model(torch.randn(2, 4, dtype=dtype)).sum().backward()
        opt.step()
        opt.zero_grad()
        engine.step_end(step)
    engine.flush()
