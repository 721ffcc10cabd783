"""torch.compile: the guard's checks trace into the model's graph (no graph break, no host read
inside it), a model compiled before or after attach is guarded, and a fault inside a compiled
vision tower is caught at the commit point and healed by the fuse.

The fast tests compile with dynamo's "eager" backend (the graph is captured as inductor would
see it, then run as is: what can break a graph is dynamo's, not the backend's). The tiny
Hugging Face LLaVA runs under inductor on the CPU, compiled once for the module (slow)."""

from __future__ import annotations

import logging

import pytest
import structlog
import torch
from torch._dynamo.utils import counters

import mscale
from mscale.findings import Reason
from mscale.sim.tinymm import TinyConfig, TinyMultimodal


@pytest.fixture(autouse=True)
def quiet_logs():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    yield
    structlog.reset_defaults()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def tiny_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 64, (4, 9), generator=g)


def train(call, opt, steps: range) -> list[float]:
    losses = []
    for s in steps:
        out = call(*tiny_batch(s))
        out["loss"].backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(out["loss"].detach()))
    return losses


def unique_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


class ColumnFault:
    """The test's own fault: adds `size` to one output column of a linear layer, in every row
    (as a stuck accumulator lane would), while `on` (a tensor: flipping it recompiles nothing)
    is 1. Registered on the module before its first compiled call, so dynamo traces it, in front
    of the guard's check when registered after attach (prepend: the check sees what the faulty
    GEMM produced)."""

    def __init__(self, linear: torch.nn.Module, *, column: int = 3, size: float = 1.0) -> None:
        self.on = torch.zeros(())
        self.column, self.size = column, size
        self.handle = linear.register_forward_hook(self._hit, prepend=True)

    def _hit(self, module, args, out):
        bump = torch.zeros(out.shape[-1], dtype=out.dtype)
        bump[self.column] = self.size
        return out + self.on * bump


def test_the_checks_trace_into_one_graph_fullgraph_on_an_mpu_and_on_the_model():
    """fullgraph=True raises at the first graph break: the MPU with the guard's hooks (its own
    and each linear's) compiles whole, and so does the model compiled after attach; the checks
    ran inside the graph and were read once a step, at the commit point."""
    model = TinyMultimodal(TinyConfig())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = mscale.attach(model, opt, job_id="c", connect=False)
    vision = guard.mpu("vision")
    out = torch.compile(vision.module, fullgraph=True, backend="eager")(tiny_batch(0)[0])
    assert out.shape == (4, 16, 32)
    slot = guard.checksum.graph._slots[vision.mpu_id]
    assert slot.traced and (slot.values[:, 1] > 0).sum() >= 4  # tolerances written: the checks ran
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    reads0 = guard.checksum.readbacks
    losses = train(compiled, opt, range(4))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert unique_graphs() == 1 and not counters["graph_break"]
    assert guard.checksum._graph_mpus == {m.mpu_id for m in guard.mpus}
    assert guard.checksum.readbacks - reads0 == 4  # one read-back a step, at the commit point
    assert not [f for f in guard.findings if f.source == "checksum"]  # clean steps are quiet
    figures = guard.checksum.figures()
    assert all(f["coverage_ratio"] == 1 / 8 and f["max_gap_steps"] == 8 for f in figures.values())
    guard.detach()


def test_a_model_compiled_before_attach_is_unwrapped_and_its_hooks_sit_on_the_wrapper():
    model = TinyMultimodal(TinyConfig())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = torch.compile(model, backend="eager")
    guard = mscale.attach(compiled, opt, job_id="c", connect=False, snapshots=True)
    assert guard.model is model and [m.path for m in guard.mpus] == [
        "vision_tower",
        "multi_modal_projector",
        "language_model",
    ]
    # the step's begin (and L3's capture of the batch): outside the graph
    assert len(compiled._forward_pre_hooks) == 2 and not model._forward_pre_hooks
    train(compiled, opt, range(3))
    assert guard.current_step == 3 and unique_graphs() == 1 and not counters["graph_break"]
    assert guard.checksum._graph_mpus == {m.mpu_id for m in guard.mpus}
    assert not [f for f in guard.findings if f.source == "checksum"]
    guard.detach()
    assert not compiled._forward_pre_hooks and not model._forward_hooks


def test_a_fault_in_a_compiled_tower_fails_its_step_at_the_commit_point_then_l1():
    """One element of one row: the sampled rows (every 8th, rotating) find it within 8 steps;
    the failed step's update is dropped, the MPU goes to incident mode (every row: one
    recompile), and the next failed steps make the L1 trigger."""
    model = TinyMultimodal(TinyConfig())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    linear = next(m for m in model.vision_tower.modules() if isinstance(m, torch.nn.Linear))
    state = {"on": torch.zeros(())}

    def one_element(module, args, out):  # row 5 of the flattened output, column 0
        hit = torch.zeros_like(out).reshape(-1, out.shape[-1])
        hit[5, 0] = 8.0
        return out + state["on"] * hit.reshape(out.shape)

    guard = mscale.attach(model, opt, job_id="c", connect=False)
    linear.register_forward_hook(one_element, prepend=True)  # after attach: in front of its check
    compiled = torch.compile(model, backend="eager")
    train(compiled, opt, range(2))
    state["on"].fill_(1.0)
    first = None
    for s in range(2, 12):
        before = {n: p.detach().clone() for n, p in model.vision_tower.named_parameters()}
        train(compiled, opt, range(s, s + 1))
        failed = [f for f in guard.findings if f.reason is Reason.CHECKSUM_FAILURE and f.labels["step"] == str(s)]
        if failed:
            first = s
            (f,) = failed
            assert f.labels["mpu_id"] == "001" and f.labels["method"] == "abft"
            name = next(n for n, m in model.vision_tower.named_modules() if m is linear)
            assert f"layer {name} " in f.message
            # the update of the failed step was dropped
            assert all(torch.equal(p, before[n]) for n, p in model.vision_tower.named_parameters())
            break
    assert first is not None and first - 2 < 8  # within max_gap_steps
    train(compiled, opt, range(first + 1, first + 3))
    assert guard.checksum.graph.stride_of("001") == 1  # incident mode from the next step: every row
    l1 = [f for f in guard.findings if f.reason is Reason.CHECKSUM_L1_TRIGGER]
    assert l1 and l1[0].labels["mpu_id"] == "001" and int(l1[0].labels["step"]) == first + 2
    assert unique_graphs() == 2 and not counters["graph_break"]  # the incident's graph, no more
    guard.detach()


# --- a tiny Hugging Face LLaVA under inductor -----------------------------------------

transformers = pytest.importorskip("transformers")


class Items(torch.utils.data.Dataset):
    def __init__(self, make_batch, steps: int) -> None:
        self.make_batch, self.steps = make_batch, steps

    def __len__(self) -> int:
        return 4 * self.steps

    def __getitem__(self, i: int) -> dict:
        batch = self.make_batch(i // 4, torch.Generator().manual_seed(i // 4))
        return {k: v[i % 4] for k, v in batch.items()}


class Breaks(logging.Handler):
    """Dynamo's graph-break log records (each carries the user code's stack)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


@pytest.fixture(scope="module")
def llava():
    """The README's line on a tiny LLaVA compiled (inductor) before attach, its vision fault
    hook traced into the graph: compiled once for every test below."""
    from support.tiny_hf import tiny_llava

    torch._dynamo.reset()
    model, make_batch = tiny_llava(seed=0)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    breaks = Breaks()
    torch._logging.set_logs(graph_breaks=True)
    logging.getLogger("torch._dynamo").addHandler(breaks)
    loader = mscale.ResumableLoader(Items(make_batch, 400), batch_size=4, seed=0)
    findings: list = []

    class Keep:
        def on_finding(self, f) -> None:
            findings.append(f)

    compiled = torch.compile(model)  # inductor; compiled on the first call
    guard = mscale.attach(compiled, opt, job_id="llava", snapshots=True, data=loader, connect=False, plugins=[Keep()])
    # after attach (in front of the guard's check), before the first call (traced into the graph)
    fault = ColumnFault(next(m for m in model.model.vision_tower.modules() if isinstance(m, torch.nn.Linear)))
    run = {"model": model, "compiled": compiled, "opt": opt, "guard": guard, "loader": iter(loader)}
    run.update(fault=fault, findings=findings, breaks=breaks)
    yield run
    guard.detach()
    logging.getLogger("torch._dynamo").removeHandler(breaks)
    torch._logging.set_logs()
    torch._dynamo.reset()


def step(run) -> float:
    batch = next(run["loader"])
    out = run["compiled"](**batch)
    out.loss.backward()
    run["opt"].step()
    run["opt"].zero_grad()
    return float(out.loss.detach())


@pytest.mark.slow
@pytest.mark.timeout(2400)  # inductor compiles the model here: minutes on a loaded 2-core CPU
def test_tiny_llava_under_inductor_trains_guarded_clean_steps_quiet(llava):
    guard, findings = llava["guard"], llava["findings"]
    losses = [step(llava) for _ in range(6)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert guard.current_step == 6
    assert guard.checksum._graph_mpus == {m.mpu_id for m in guard.mpus}  # every MPU ran in the graph
    assert not [f for f in findings if f.source in ("checksum", "fuse")], findings
    # LLaVA's own code breaks the graph (its placeholder-mask check, ...): none of ours does
    ours = [r for r in llava["breaks"].records if "mscale" in r]
    assert not ours, ours[:1]


@pytest.mark.slow
@pytest.mark.timeout(2400)  # the incident's graph (every row) is compiled here
def test_tiny_llava_under_inductor_a_persistent_vision_fault_is_caught_and_healed_by_l1(llava):
    """The fault belongs to the tower's simulated GPU: on while the tower runs there, gone once
    the fuse's L1 swap moves it to a standby. Caught in its first step (every row carries it);
    each failed step is rolled back and re-run on its batch (the commit point's re-run), L1
    follows the third failed check, then the steps on the standby are clean."""
    guard, findings, fault = llava["guard"], llava["findings"], llava["fault"]
    vision = guard.mpu("vision")
    bad_gpu, start = vision.gpu, guard.current_step

    def failures() -> list:
        return [f for f in findings if f.reason is Reason.CHECKSUM_FAILURE]

    seen = []
    for _ in range(24):
        fault.on.fill_(1.0 if vision.gpu == bad_gpu else 0.0)
        step(llava)
        seen.append(len(failures()))
    failed = failures()
    assert failed and int(failed[0].labels["step"]) == start and failed[0].labels["mpu_id"] == vision.mpu_id
    l1 = [f for f in findings if f.reason is Reason.CHECKSUM_L1_TRIGGER]
    assert l1 and l1[0].labels["mpu_id"] == vision.mpu_id
    before_l1 = findings[: findings.index(l1[0])]
    assert sum(f.reason is Reason.CHECKSUM_FAILURE for f in before_l1) <= 3  # within 3 checked steps
    states = [f.labels["state"] for f in findings if f.reason is Reason.FUSE_STATE and f.labels["mpu_id"] == "001"]
    assert "l1_swapped" in states and vision.gpu != bad_gpu
    assert len(set(seen[-8:])) == 1  # healed: no failure in the last 8 iterations
    assert not [r for r in llava["breaks"].records if "mscale" in r]
