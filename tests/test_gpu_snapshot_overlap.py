"""On a GPU, the in-memory snapshot's copy of parameters and optimizer state runs on a side
stream into pinned host buffers beside the next forward and backward; the optimizer step's
stream waits for it on the device (the host never blocks), and the snapshot is still the
exact pre-step state. Marked `gpu`: conftest skips it without one (`make gpu-check` runs it)."""

from __future__ import annotations

import pytest
import torch

from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal
from mscale.snapshot.config import SnapshotConfig
from mscale.snapshot.engine import SnapshotEngine

pytestmark = pytest.mark.gpu


def test_the_copy_overlaps_the_next_step_on_a_side_stream_and_restores_exactly() -> None:
    torch.manual_seed(0)
    cfg = TinyConfig()
    model = TinyMultimodal(cfg).to("cuda:0")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = SyntheticCaptions(cfg, size=16)
    batch = {k: torch.stack([data[i][k] for i in range(8)]).to("cuda:0") for k in ("images", "tokens")}

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(batch["images"], batch["tokens"])["loss"].backward()
        opt.step()

    engine = SnapshotEngine(
        model, opt, config=SnapshotConfig(memory_every=0), mpus={"vision": ("001", model.vision_tower)}
    )
    step()  # the optimizer state exists
    torch.cuda.synchronize()
    before = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    moments = {(n, k): v.cpu().clone() for n, p in model.named_parameters() for k, v in opt.state[p].items()}
    torch.cuda._sleep(int(2e9))  # hold the compute stream: the side stream starts after it
    snap = engine.snapshot(step=1)
    assert not snap.is_ready(), "the copy finished at once: it did not wait for the compute stream"
    waits = engine.copier.waits
    step()  # enqueued behind the copy on the device; the host does not wait
    assert engine.copier.waits == waits
    snap.wait_ready()
    assert all(t.is_pinned() for d in snap.tensors.values() for t in d.values())
    assert engine.rollback() == 1
    torch.cuda.synchronize()
    for k, v in model.state_dict().items():
        assert torch.equal(v.cpu(), before[k]), k
    for (n, k), v in moments.items():
        assert torch.equal(opt.state[dict(model.named_parameters())[n]][k].cpu(), v), (n, k)
    engine.close()
