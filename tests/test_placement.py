"""Moving an MPU between devices (mscale.hook.fuse.placement), rebind's uuid, the replay's BatchNorm
statistics and the TF32 tolerance, on the CPU.

This machine has two devices, `cpu` and `meta` (shapes and devices, no data). Moves from cpu to
meta are real moves through the same code a CUDA move takes; nothing can be copied out of meta,
so what needs a move back to a device with data (a CUDA MPU's outputs arriving as numbers on
cuda:0, L2's move to the CPU and back, TF32 GEMMs) is left to the gpu-marked tests.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from mscale.hook.checks.checksum import DEFAULT_RTOL, TF32_RTOL, ChecksumConfig
from mscale.hook.core.attach import attach
from mscale.hook.fuse.placement import adapt, boundary, map_tensors, move, place, tensors

META = torch.device("meta")
CPU = torch.device("cpu")


def _stepped(opt_cls=torch.optim.Adam, **kw) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
    opt = opt_cls(m.parameters(), lr=1e-2, **kw)
    m(torch.randn(5, 4)).square().sum().backward()
    opt.step()
    return m, opt


def test_move_takes_parameters_gradients_buffers_and_optimizer_state() -> None:
    m, opt = _stepped()
    move(m, opt, "meta")  # (to meta, Module.to makes new Parameter objects: the optimizer follows them)
    params = list(m.parameters())
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in params]
    assert len(opt.state) == len(params)
    assert all(p.device == META and p.grad is not None and p.grad.device == META for p in params)
    assert all(b.device == META for b in m.buffers())  # running_mean, running_var, num_batches_tracked
    for p in params:
        st = opt.state[p]
        assert st["exp_avg"].device == META and st["exp_avg_sq"].device == META
        assert st["step"].device == CPU  # the for-each/for-loop Adam keeps its step counter there


def test_a_fused_optimizers_step_counter_moves_with_its_parameter() -> None:
    m, opt = _stepped(fused=True)  # fused Adam keeps `step` on the parameter's device
    move(m, opt, "meta")
    assert all(opt.state[p]["step"].device == META for p in m.parameters())


def test_sgd_momentum_and_no_optimizer() -> None:
    m, opt = _stepped(torch.optim.SGD, momentum=0.9)
    move(m, opt, "meta")
    assert all(opt.state[p]["momentum_buffer"].device == META for p in m.parameters())
    bare = nn.Linear(2, 2)
    move(bare, None, "meta")
    assert bare.weight.device == META


class Mpu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x, extra=None):
        y = self.inner(x)
        return {"y": y, "pair": (y, [y * 2])}


def test_the_adapter_takes_inputs_to_the_mpu_and_sends_outputs_back_to_their_device() -> None:
    """The MPU moved off its callers' device: its inner layers see their inputs on the MPU's
    device, and its outputs head back to the device the inputs came from. Here that device is
    the CPU and the outputs are meta tensors, which hold no data: the return copy fails, as the
    only thing that differs from CUDA (cuda:1 -> cuda:0 copies the numbers). GPU-only: the
    outputs' values on cuda:0."""
    model = nn.Sequential(OrderedDict(pre=nn.Linear(4, 4), mpu=Mpu()))
    seen = []
    model.mpu.inner.register_forward_pre_hook(lambda mod, args: seen.append(args[0].device))
    place(model.mpu, None, "meta")
    assert boundary(model.mpu) is not None and boundary(model.mpu).home == CPU
    with pytest.raises(NotImplementedError, match="meta"):
        model(torch.randn(2, 4))
    assert seen == [META]  # routed in
    assert boundary(model.mpu).calls == 1


def test_outputs_return_home_nested_and_the_adapter_leaves_when_the_mpu_comes_back() -> None:
    """An MPU on the CPU whose callers run on meta: a call without tensor inputs gets its
    outputs, nested in dicts, tuples, lists and a dict subclass (ModelOutput's kind), on the
    home device; a call whose inputs come from the CPU gets them on the CPU. Moving the MPU home
    removes the adapter. GPU-only: the same with cuda:0 and cuda:1."""

    class Output(dict):
        pass

    class FromParams(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, n: int, x=None):
            y = self.w * n if x is None else self.w * x
            return Output(a=y, b=(y, [y + 1]), c="tag")

    mod = FromParams()
    b = adapt(mod, "meta")
    out = mod(2)
    assert isinstance(out, Output) and out["c"] == "tag"
    assert [t.device for t in tensors(out)] == [META] * 3
    out = mod(2, x=torch.ones(3))
    assert [t.device for t in tensors(out)] == [CPU] * 3  # inputs from the CPU: back to the CPU
    assert torch.equal(out["a"], torch.ones(3))
    assert b.calls == 2 and "forward" in mod.__dict__
    place(mod, None, "meta")  # home
    assert boundary(mod) is None and "forward" not in mod.__dict__
    assert mod(2)["a"].device == META  # its own device now, no adapter in the way


def test_map_tensors_keeps_the_structure() -> None:
    from typing import NamedTuple

    class Pair(NamedTuple):
        a: torch.Tensor
        b: int

    obj = {"x": [torch.zeros(1), (torch.ones(1), 3)], "p": Pair(torch.zeros(2), 7)}
    out = map_tensors(obj, lambda t: t.to("meta"))
    assert isinstance(out["p"], Pair) and out["p"].b == 7 and out["x"][1][1] == 3
    assert [t.device for t in tensors(out)] == [META] * 3


class TwoTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision_tower = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
        self.language_model = nn.Linear(4, 1)

    def forward(self, x):
        return self.language_model(self.vision_tower(x)).square().mean()


def test_rebind_moves_the_optimizer_state_and_installs_the_adapter() -> None:
    torch.manual_seed(0)
    model = TwoTower()
    opt = torch.optim.Adam(model.parameters())
    guard = attach(model, opt, job_id="t", connect=False, cmsa=False)
    model(torch.randn(6, 4)).backward()
    opt.step()
    m = guard.mpu("vision")
    guard.rebind(m, 5, device="meta")
    assert m.device == META and m.gpu == 5
    assert all(opt.state[p]["exp_avg"].device == META for p in m.parameters())
    assert boundary(m.module) is not None and boundary(m.module).home == CPU
    guard.detach()


def test_rebind_keeps_a_truthful_gpu_uuid() -> None:
    model = TwoTower()
    guard = attach(model, None, job_id="t", connect=False, cmsa=False)
    vision, text = guard.mpu("vision"), guard.mpu("text")
    guard.rebind(vision, 4, gpu_uuid="GPU-four")  # given: taken
    assert vision.gpu_uuid == "GPU-four"
    guard.rebind(vision, 4)  # same GPU, none given: kept
    assert vision.gpu_uuid == "GPU-four"
    guard.rebind(text, 4)  # a GPU this job has seen: its uuid
    assert text.gpu_uuid == "GPU-four"
    guard.rebind(vision, 6, gpu_uuid="GPU-six")
    guard.rebind(vision, 4)  # back to a GPU no MPU is bound to now: still known
    assert vision.gpu_uuid == "GPU-four"
    guard.rebind(vision, 7)  # simulated (on the CPU), never seen: unknown, never another GPU's uuid
    assert vision.gpu_uuid == ""
    assert {d.mpu_id: d.gpu_uuid for d in (x.describe() for x in guard.mpus)}[text.mpu_id] == "GPU-four"
    guard.detach()


def _bn_run(replay_every: int) -> tuple[list[torch.Tensor], int]:
    torch.manual_seed(0)
    model = TwoTower()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = ChecksumConfig(replay_every=replay_every)
    guard = attach(model, opt, job_id="t", connect=False, cmsa=False, checksum=cfg)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        model(torch.randn(6, 4, generator=gen)).backward()
        opt.step()
        opt.zero_grad()
    checks = guard.mpu("vision").checksum_checks_total
    guard.detach()
    bn = model.vision_tower[1]
    return [bn.running_mean.clone(), bn.running_var.clone(), bn.num_batches_tracked.clone()], checks


def test_the_replay_leaves_batchnorm_running_statistics_as_one_forward_left_them() -> None:
    replayed, n = _bn_run(replay_every=1)  # every step replayed
    plain, _ = _bn_run(replay_every=0)
    assert n == 2 and int(replayed[2]) == 2
    for a, b in zip(replayed, plain, strict=True):
        assert torch.equal(a, b)


def test_tolerance_by_dtype_device_and_tf32() -> None:
    cfg = ChecksumConfig()
    f32 = DEFAULT_RTOL[torch.float32]
    assert cfg.tolerance(torch.float32) == f32
    assert cfg.tolerance(torch.float32, "cpu", tf32=True) == f32  # TF32 is a CUDA matmul mode
    assert cfg.tolerance(torch.float32, "cuda:0", tf32=False) == f32
    assert cfg.tolerance(torch.float32, torch.device("cuda", 1), tf32=True) == TF32_RTOL
    assert cfg.tolerance(torch.bfloat16, "cuda", tf32=True) == DEFAULT_RTOL[torch.bfloat16]
    assert cfg.tolerance(torch.float16, "cuda", tf32=True) == DEFAULT_RTOL[torch.float16]
    assert ChecksumConfig(tf32_rtol=5e-3).tolerance(torch.float32, "cuda", tf32=True) == 5e-3
    loose = ChecksumConfig(rtol={torch.float32: 1e-2})  # a looser float32 rtol stays the looser
    assert loose.tolerance(torch.float32, "cuda", tf32=True) == 1e-2


def test_tolerance_reads_the_tf32_flag() -> None:
    cfg = ChecksumConfig()
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert cfg.tolerance(torch.float32, "cuda") == TF32_RTOL
        torch.backends.cuda.matmul.allow_tf32 = False
        assert cfg.tolerance(torch.float32, "cuda") == DEFAULT_RTOL[torch.float32]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
