"""MSRP: the micro-probes on the host, each MPU's FLOP count and achieved FLOP/s from a real
training run, the profile in every snapshot's resource_binding.json, and the L1 standby chosen
by measured profile (ranking, and a real swap on the tiny model)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mscale.contracts.msrp import choose_standby, rank_standby, score
from mscale.hook.core.attach import attach
from mscale.hook.core.msrp import MsrpPlugin, probe_device
from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal


def fast(lo: float = 1.0) -> dict:
    return {"bandwidth_bytes_per_s": 1e11 * lo, "matmul_flops": 1e14 * lo, "dtype": "bfloat16", "measured_at": 1.0}


def test_host_micro_probes_measure_positive_figures() -> None:
    p = probe_device("cpu", repeats=3)
    assert p["dtype"] == "float32"
    assert 1e6 < p["bandwidth_bytes_per_s"] < 1e13 and math.isfinite(p["bandwidth_bytes_per_s"])
    assert 1e6 < p["matmul_flops"] < 1e14
    assert p["measured_at"] > 1.7e9


def train(guard_kw: dict, steps: int, plugin: MsrpPlugin):
    torch.manual_seed(0)
    cfg = TinyConfig()
    model = TinyMultimodal(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = attach(model, opt, job_id="msrp", connect=False, cmsa=False, plugins=[plugin], **guard_kw)
    loader = iter(torch.utils.data.DataLoader(SyntheticCaptions(cfg, size=64), batch_size=4))
    batch = None
    for _ in range(steps):
        batch = next(loader)
        model(batch["images"], batch["tokens"])["loss"].backward()
        opt.step()
        opt.zero_grad()
    return guard, model, opt, batch


def test_each_mpu_gets_its_counted_flops_and_achieved_rate(tmp_path: Path) -> None:
    plugin = MsrpPlugin(interval_s=3600, report_s=3600)
    guard, model, opt, batch = train({}, 4, plugin)
    try:
        # an independent count of the vision tower's forward on a batch of the same shape
        with FlopCounterMode(display=False) as count:
            model.vision_tower(batch["images"])
        vision = plugin.mpus["001"]
        assert vision["flops_per_step"] == 3 * count.get_total_flops() > 0
        for mpu_id in ("001", "002", "003"):
            m = plugin.mpus[mpu_id]
            assert 0 < m["achieved_flops"] < 1e14  # real timings of a CPU run
            params = sum(p.numel() * 4 for p in guard.mpu(mpu_id).module.parameters())
            assert m["memory_bytes"] >= 3 * params  # parameters, and AdamW's two moments at least
        assert plugin.mpus["003"]["flops_per_step"] > plugin.mpus["002"]["flops_per_step"]
        devices, _ = plugin.msrp_profiles()
        assert set(devices) == {0, 1, 2} and devices[0] is devices[2]  # one host, probed once
    finally:
        guard.detach()


def test_every_snapshot_holds_the_msrp_beside_the_binding(tmp_path: Path) -> None:
    from mscale.hook.core.protect import SnapshotConfig

    plugin = MsrpPlugin(interval_s=3600, report_s=3600)
    cfg = SnapshotConfig(directory=str(tmp_path), disk_every=1)
    guard, *_ = train({"snapshots": cfg, "resume": False}, 3, plugin)
    guard.detach()  # flushes the writer
    bindings = sorted(tmp_path.rglob("resource_binding.json"))
    assert bindings, "no disk snapshot written"
    mpus = json.loads(bindings[-1].read_text())["mpus"]
    assert mpus["001"]["msrp"]["mpu"]["flops_per_step"] == plugin.mpus["001"]["flops_per_step"]
    assert mpus["003"]["msrp"]["device"]["dtype"] == "float32"
    assert mpus["002"]["gpu"] == 1  # the binding itself is unchanged


def test_standby_ranking_prefers_the_best_measured_profile() -> None:
    profiles = {3: fast(0.5), 4: fast(2.0), 5: fast(1.0)}
    assert rank_standby([3, 4, 5, 6], profiles) == [4, 5, 3, 6]  # unmeasured last
    assert rank_standby([6, 7], {}) == [6, 7]  # nothing measured: the caller's order
    bandwidth_rich = {**fast(1.0), "bandwidth_bytes_per_s": 1e12}
    compute_rich = {**fast(1.0), "matmul_flops": 1e15}
    both = {3: bandwidth_rich, 4: compute_rich}
    assert rank_standby([3, 4], both, weight=1.0) == [4, 3]  # a compute-bound MPU
    assert rank_standby([3, 4], both, weight=0.0) == [3, 4]  # a memory-bound one
    assert score(None) == 0.0 and score({"matmul_flops": float("nan")}) == 0.0


@pytest.mark.slow  # a 40-step fuse run on the tiny model: about 5 s
def test_an_l1_swap_goes_to_the_standby_with_the_best_profile() -> None:
    from mscale.demo.scenario import Fault, RunConfig, run

    plugin = MsrpPlugin(interval_s=3600, report_s=3600)

    def once(r) -> None:
        if plugin.guard is None:
            r.guard.add_plugin(plugin)
            # the node's other GPUs as measured: GPU 6 the fastest, 3 (the first free) slow
            plugin.devices.update({3: fast(0.3), 4: fast(1.0), 5: fast(0.8), 6: fast(3.0), 7: fast(1.1)})

    r = run(
        RunConfig(
            steps=40,
            faults=(Fault(30, "corrupt", {"gpu": 0, "mode": "noise", "steps": 20}),),
            before_step=once,
        )
    )
    swaps = [f for f in r.actions("l1_swap", "applied")]
    assert len(swaps) == 1 and swaps[0].labels["to_gpu"] == "6"
    assert r.guard.mpu("vision").gpu == 6
    assert choose_standby(r.guard, r.guard.mpu("vision"), [3, 4, 5, 7]) == 7


def test_a_forward_that_raises_leaves_no_counting_mode_behind() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from mscale.hook.core.msrp import _FlopCount

    class Flaky(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.fail = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lin(x)
            if self.fail:
                raise RuntimeError("bad batch")
            return y

    m = Flaky()
    count = _FlopCount(m)
    with pytest.raises(RuntimeError):
        m(torch.ones(2, 4))
    assert _get_current_dispatch_mode() is None and count.flops is None  # left; nothing counted
    m.fail = False
    m(torch.ones(2, 4))
    assert count.flops == 2 * 2 * 4 * 4  # the first whole forward's matmul
    m(torch.ones(8, 4))
    assert count.flops == 2 * 2 * 4 * 4  # counted once, then unhooked


@pytest.mark.gpu
def test_gpu_micro_probes_and_the_nvml_view_of_the_node() -> None:
    """On a GPU node: bf16 matmul and copy bandwidth in a GPU's range, and every GPU found by
    NVML with a full BDF of its own."""
    from mscale.contracts.hardware import nvml_pci, read_host

    p = probe_device("cuda:0", repeats=5)
    assert p["dtype"] == "bfloat16"
    assert p["matmul_flops"] > 1e12 and p["bandwidth_bytes_per_s"] > 1e11  # any data-centre GPU
    pci = nvml_pci()
    assert pci is not None
    host = read_host("/sys", "/proc", pci)
    assert host.gpu_source == "nvml" and len(host.gpus) == torch.cuda.device_count() == pci.device_count()
    from mscale.contracts.hardware import normalize_bdf

    bdfs = [g.bdf for g in host.gpus]
    assert all(normalize_bdf(b) == b for b in bdfs) and len(set(bdfs)) == len(bdfs)
