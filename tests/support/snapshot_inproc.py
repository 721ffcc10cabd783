"""A small training job in the test process, driven step by step by the snapshot tests."""

from __future__ import annotations

import random

import numpy as np
import torch

from mscale.snapshot.config import SnapshotConfig
from mscale.snapshot.engine import (
    SnapshotEngine,
)
from support.snapshot_job import build, train_step


class Job:
    """A small training job in this process, driven step by step."""

    def __init__(self, directory=None, *, job_id: str = "", **settings):
        self.model, self.opt, self.sched, self.scaler, self.loader, self.mpus = build(dataset_size=256)
        self.engine = SnapshotEngine(
            self.model,
            self.opt,
            # the disk tier's tests: the node tier (node_tier.py) only where a test asks for it
            config=SnapshotConfig(directory=directory, **{"node_every": 0, **settings}),
            mpus=self.mpus,
            scaler=self.scaler,
            scheduler=self.sched,
            data=self.loader,
            job_id=job_id,
        )
        self.seen: dict[int, list[int]] = {}

    def draw(self, step):
        batch = self.loader.next_batch()
        self.seen[step] = [int(i) for i in batch["index"]]
        return batch

    def step(self, step, *, fault=False):
        batch = self.draw(step)
        loss = train_step(self.model, batch, step, fault=fault, nan_batch=False)
        if not torch.isfinite(loss):
            return False
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.sched.step()
        self.engine.step_end(step)
        return True

    def run(self, first, last):
        for s in range(first, last + 1):
            assert self.step(s)

    def state(self):
        """Everything a restore must bring back, copied."""
        return {
            "params": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optim": {
                (n, k): v.clone() for n, p in self.model.named_parameters() for k, v in self.opt.state[p].items()
            },
            "lr": self.sched.get_last_lr(),
            "scale": self.scaler.get_scale(),
            "tracker": self.scaler._get_growth_tracker(),
            "data": self.loader.position(),
            "rng": (torch.get_rng_state().clone(), random.getstate(), np.random.get_state()[1].copy()),
        }

    def close(self):
        self.engine.close()


def two_disk_snapshots(directory):
    """A job that wrote disk snapshots of steps 10 and 20 to `directory` and closed; returns
    its state at step 10 (what a fallback from a refused step 20 must restore)."""
    job = Job(directory, memory_every=10, disk_every=10)
    job.run(1, 10)
    job.engine.flush()
    at10 = job.state()
    job.run(11, 20)
    job.engine.flush()
    job.close()
    return at10
