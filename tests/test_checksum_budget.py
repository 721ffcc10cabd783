"""Checks within a budget (mscale.hook.checks.budget, mscale.hook.checks.coverage): rotation bounds, incident
mode on suspicion, per-optimizer-step counting, checks done once under activation
checkpointing, verdicts read once per step at the commit point. Tiny multimodal model on CPU,
faults from the test's own forward hooks."""

from __future__ import annotations

import pytest
import torch

from mscale.findings import Finding, Reason, Severity
from mscale.hook.checks.budget import Budget
from mscale.hook.checks.checksum import ChecksumConfig
from mscale.hook.checks.coverage import suspicions
from mscale.hook.core.attach import attach
from mscale.sim.inject import inject
from mscale.sim.tinymm import SyntheticCaptions, TinyConfig, TinyMultimodal

CFG = TinyConfig()
FAIL = (Reason.CHECKSUM_FAILURE, Reason.NONFINITE_OUTPUT)


class Findings:
    def __init__(self) -> None:
        self.items: list[Finding] = []

    def on_finding(self, f: Finding) -> None:
        self.items.append(f)

    def steps(self, *reasons: Reason, mpu: str | None = None) -> list[int]:
        return sorted(
            {
                int(f.labels["step"])
                for f in self.items
                if f.reason in reasons and (mpu is None or f.labels.get("mpu") == mpu)
            }
        )


def job(checksum: ChecksumConfig | None = None, *, micro: int = 1, seed: int = 0):
    torch.manual_seed(seed)
    model = TinyMultimodal(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rec = Findings()
    guard = attach(model, opt, job_id="b", connect=False, plugins=[rec], cmsa=False, checksum=checksum)
    data = SyntheticCaptions(CFG, size=100_000, seed=seed)
    state = {"i": 0}

    def train(n: int) -> None:
        for _ in range(n):
            for _ in range(micro):
                b = torch.utils.data.default_collate([data[state["i"] * 4 + j] for j in range(4)])
                state["i"] += 1
                (model(b["images"], b["tokens"])["loss"] / micro).backward()
            opt.step()
            opt.zero_grad()

    return guard, train, rec


class Checked:
    """Which layers the checksum really checked in each step (a spy on its ABFT work)."""

    def __init__(self, guard) -> None:
        self.by_step: dict[int, set[int]] = {}
        det = guard.checksum
        original = det._abft_sums

        def spy(mpu, st, module, *rest):
            self.by_step.setdefault(guard.current_step, set()).add(id(module))
            return original(mpu, st, module, *rest)

        det._abft_sums = spy
        # the linears that run (MultiheadAttention's out_proj does not: its weight is read by
        # the functional form), the ones the rotation must cover
        self.ran: set[int] = set()
        for m in guard.model.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_hook(lambda mod, a, o: self.ran.add(id(mod)))


def _layer(guard, mpu: str, index: int) -> torch.nn.Linear:
    linears = [m for m in guard.mpu(mpu).module.modules() if isinstance(m, torch.nn.Linear)]
    return linears[index]


def test_every_layer_is_checked_within_max_gap_steps_and_the_figures_say_so() -> None:
    guard, train, rec = job(ChecksumConfig(max_gap_steps=4))
    spy = Checked(guard)
    train(16)
    for m in guard.mpus:
        layers = [id(x) for x in m.module.modules() if isinstance(x, torch.nn.Linear) and id(x) in spy.ran]
        assert layers
        for layer in layers:
            steps = sorted(s for s, ids in spy.by_step.items() if layer in ids)
            gaps = [b - a for a, b in zip([-1, *steps], [*steps, 16], strict=True)]
            assert max(gaps) <= 4, (m.name, steps)
    figures = guard.summary()["checksum"]
    assert set(figures) == {m.mpu_id for m in guard.mpus}
    assert all(f["max_gap_steps"] <= 4 and 0 < f["coverage_ratio"] <= 1 for f in figures.values())
    assert 0 < guard.summary()["guard_overhead_ratio"] < 10
    assert rec.steps(*FAIL) == []


def test_sampling_checks_fewer_layers_than_full_coverage() -> None:
    sampled, train_s, _ = job(ChecksumConfig(budget=0.0, max_gap_steps=8))
    full, train_f, _ = job(ChecksumConfig(full=True))
    spy_s, spy_f = Checked(sampled), Checked(full)
    train_s(8)
    train_f(8)
    n_s = sum(len(v) for v in spy_s.by_step.values())
    n_f = sum(len(v) for v in spy_f.by_step.values())
    ran = [[x for x in m.module.modules() if id(x) in spy_f.ran] for m in full.mpus]
    assert n_f == 8 * sum(len(r) for r in ran)
    # budget 0: every layer in the step it is first seen running, then the floors only,
    # ceil(L / 8) layers of each MPU a step
    assert n_s == sum(len(r) for r in ran) + 7 * sum(-(-len(r) // 8) for r in ran) < n_f


@pytest.mark.parametrize("mpu", ["vision", "aligner", "text"])
def test_a_persistent_fault_is_caught_within_max_gap_and_l1_follows_within_3_checked_steps(mpu: str) -> None:
    guard, train, rec = job(ChecksumConfig(budget=0.0, max_gap_steps=8, replay_every=0))
    train(2)
    layer = _layer(guard, mpu, -1)  # the last in the rotation order

    def hit(module, args, out):
        out = out.clone()  # what a faulty GEMM returned (registered in front of the checks)
        out.view(-1)[3] = out.view(-1)[3] + 1e3
        return out

    layer.register_forward_hook(hit, prepend=True)
    train(12)
    failed = rec.steps(Reason.CHECKSUM_FAILURE, mpu=mpu)
    assert failed and failed[0] - 2 < 8, failed  # within max_gap_steps of the fault's first step
    (first_l1, *_) = rec.steps(Reason.CHECKSUM_L1_TRIGGER, mpu=mpu)
    assert first_l1 - failed[0] <= 2  # the third failed checked step at most
    # incident mode: every step from the first failure on checks the faulty layer
    assert failed == list(range(failed[0], 14))
    l1 = next(f for f in rec.items if f.reason is Reason.CHECKSUM_L1_TRIGGER)
    assert l1.labels["mpu"] == mpu and "layer" in next(
        f.message for f in rec.items if f.reason is Reason.CHECKSUM_FAILURE
    )


def test_a_transient_fault_is_caught_in_its_step_in_incident_mode() -> None:
    guard, train, rec = job(ChecksumConfig(budget=0.0, max_gap_steps=8, replay_every=0))
    train(1)
    guard.checksum.suspect(guard.mpu("vision").mpu_id, "test")  # the next step is under incident
    inj = inject(guard, kind="exponent_flip", mpu="vision", steps=1, seed=2)
    train(1)
    assert inj.hits[0].step == 1 and rec.steps(*FAIL, mpu="vision") == [1]
    assert guard.summary()["checksum"]["001"]["incident"] == 1.0
    assert guard.summary()["checksum"]["001"]["coverage_ratio"] == 1.0


def test_counts_optimizer_steps_under_4_way_gradient_accumulation() -> None:
    guard, train, rec = job(ChecksumConfig(full=True, replay_every=0), micro=4)
    train(1)
    inject(guard, kind="noise", noise_scale=0.5, mpu="vision", steps=10_000)  # every micro-batch
    train(6)
    m = guard.mpu("vision")
    assert m.checksum_checks_total == 7 and m.checksum_failures_total == 6
    assert rec.steps(Reason.CHECKSUM_L1_TRIGGER, mpu="vision") == [3, 6]  # the 3rd and 6th faulty step
    assert sum(f.reason is Reason.CHECKSUM_L1_TRIGGER for f in rec.items) == 2


def test_a_fault_at_a_towers_output_reaches_l1_through_replay_within_its_bound() -> None:
    """Noise on the vision tower's output, after its last linear: no ABFT check sees it, the
    replay does (the faulty GPU draws other noise the second time). Replays rotate with a
    ceiling of 6 steps per MPU here; the first failed replay opens an incident, so every later
    step replays and clean ABFT passes do not end the run: L1 within 6 + 2 steps."""
    guard, train, rec = job(ChecksumConfig(budget=0.0, replay_max_gap_steps=6))
    train(1)
    inject(guard, kind="noise", noise_scale=0.05, mpu="vision", site="output", steps=10_000, seed=4)
    train(8)
    failed = rec.steps(Reason.CHECKSUM_FAILURE, mpu="vision")
    assert failed and failed[0] - 1 < 6
    l1 = rec.steps(Reason.CHECKSUM_L1_TRIGGER, mpu="vision")
    assert l1 and l1[0] <= 1 + 6 + 2
    assert all(f.labels["method"] == "replay" for f in rec.items if f.reason is Reason.CHECKSUM_FAILURE)


def test_at_the_defaults_a_fault_at_a_towers_output_is_caught_within_the_replay_gap_it_reports() -> None:
    """At the defaults, replays are paid from what the budget leaves (each MPU's turn once the
    bank holds every MPU's replay), with the ceiling, 400 steps, where it leaves too little.
    The gap each MPU reports is the bound: the fault is caught by the vision tower's next
    replay, then every step replays (incident mode) and L1 follows two steps later."""
    guard, train, rec = job()
    train(20)  # the budget has step times and the replay costs their forward times
    gap = guard.summary()["checksum"]["001"]["replay_gap_steps"]
    assert 1 <= gap <= ChecksumConfig().replay_max_gap_steps == 400, gap
    start = guard.current_step
    inject(guard, kind="noise", noise_scale=0.05, mpu="vision", site="output", steps=10_000, seed=4)
    for _ in range(int(gap) + 4):
        train(1)
        if rec.steps(Reason.CHECKSUM_L1_TRIGGER, mpu="vision"):
            break
    failed = rec.steps(Reason.CHECKSUM_FAILURE, mpu="vision")
    assert failed and failed[0] - start <= gap, (failed, start, gap)
    assert rec.steps(Reason.CHECKSUM_L1_TRIGGER, mpu="vision")[0] == failed[0] + 2
    assert all(f.labels["method"] == "replay" for f in rec.items if f.reason is Reason.CHECKSUM_FAILURE)


def test_replays_are_paid_from_the_bank_alone_and_take_turns() -> None:
    """Replays from the bank with no ceiling: one MPU at a time, in turn, at the rate the bank
    pays for (replay_share of the budget a step), the first ones priced at the forward time."""
    from mscale.hook.checks.coverage import Schedule

    s = Schedule(max_gap_steps=8, replay_share=0.5, replay_max_gap_steps=0, incident_steps=4)
    for mid in ("001", "002"):
        s.add(mid, [])
    s.plan(0, 0.0, 1.0)
    assert s.replays == set()  # nothing priced yet: nothing replayed blind
    s.forward_took("001", 1.0)
    s.forward_took("002", 1.0)
    assert s.replay_gap() == 4  # 2 s of replays at 0.5 s a step
    turns = []
    for step in range(1, 13):
        s.plan(step, 0.0, 1.0)
        turns += [(step, mid) for mid in sorted(s.replays)]
    assert [mid for _, mid in turns] == ["001", "002", "001", "002", "001", "002"]
    assert all(b - a == 2 for (a, _), (b, _) in zip(turns, turns[1:], strict=False))
    s.replayed("001", 3.0)  # measured: it now costs 3 s, its forward time no longer counts
    s.forward_took("001", 1.0)
    assert s.mpus["001"].replay_cost_s == 3.0 and s.replay_gap() == 8


def test_the_bank_is_paid_only_from_what_the_budget_leaves_and_the_ceiling_still_replays() -> None:
    """Where the rest of the guard spends the whole budget (spare 0) the bank gets nothing and
    only the ceiling replays, each MPU once in its span; with half a replay's share spare, the
    bank gets that half and the gap it reports doubles."""
    from mscale.hook.checks.coverage import Schedule

    s = Schedule(max_gap_steps=8, replay_share=0.5, replay_max_gap_steps=10, incident_steps=4)
    for mid in ("001", "002"):
        s.add(mid, [])
        s.forward_took(mid, 1.0)
    replays = []
    for step in range(30):
        s.plan(step, 0.0, 1.0, spare_s=0.0)
        replays += [(step, mid) for mid in sorted(s.replays)]
    assert s.bank_s <= 0.0 and s.deposit_s == 0.0
    assert [mid for _, mid in replays] == ["001", "002"] * 3  # the ceiling's turns alone
    for mid in ("001", "002"):
        steps = [st for st, m in replays if m == mid]
        assert all(b - a == 10 for a, b in zip(steps, steps[1:], strict=False))
    assert all(f["replay_gap_steps"] == 10 for f in s.figures(30).values())

    half = Schedule(max_gap_steps=8, replay_share=0.5, replay_max_gap_steps=0, incident_steps=4)
    for mid in ("001", "002"):
        half.add(mid, [])
        half.forward_took(mid, 1.0)
    for step in range(40):
        half.plan(step, 0.0, 1.0, spare_s=0.25)
    assert half.deposit_s == pytest.approx(0.25) and half.replay_gap() == 8  # 2 s of replays at 0.25 s a step


def test_replays_are_paid_before_layers_beyond_the_floors_and_only_from_what_the_rest_leaves() -> None:
    """The bank's deposit at a step's plan, from the budget's figures (set here: a 1 s step, a
    10% budget): the guard's other work spends 0.10 s, of which 0.05 s are layers the checks
    bought beyond their floors. Those give way: the bank gets its whole share, 0.02 s. With
    nothing bought, the same spend leaves the bank nothing (the ceiling's turns alone)."""
    guard, train, _ = job(ChecksumConfig(budget=0.1, replay_share=0.2))
    train(3)  # the layers seen, the costs measured
    det, b, s = guard.checksum, guard.budget, guard.checksum.schedule
    for bought, deposit in ((0.05, 0.02), (0.0, 0.0)):
        b.step_s, b.cost_s = 1.0, {"checksum": 0.07, "guard": 0.03, "replay": 0.01}
        s.bought_s, s.deposit_s = bought, None
        det.begin_step()
        assert s.deposit_s == pytest.approx(deposit), bought


def test_an_mpu_whose_forward_runs_collectives_is_never_replayed() -> None:
    """An FSDP2-sharded tower all-gathers in its forward: replayed on one rank alone it would
    be a collective the other ranks never join. It is never replayed, not even in an incident
    or at the ceiling, while the other MPUs are; its replay gap says so (inf)."""
    import math

    from torch.distributed.fsdp import FSDPModule

    from mscale.hook.checks.coverage import Schedule
    from mscale.hook.checks.replay import runs_collectives

    sharded = torch.nn.Linear(2, 2)
    sharded.__class__ = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})  # as fully_shard does
    assert runs_collectives(torch.nn.Sequential(torch.nn.ReLU(), sharded))
    assert not runs_collectives(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(2, 2)))
    s = Schedule(max_gap_steps=8, replay_share=0.5, replay_max_gap_steps=2, incident_steps=4)
    s.add("001", [], replayable=False)
    s.add("002", [])
    for mid in ("001", "002"):
        s.forward_took(mid, 1.0)
        s.suspect(mid, 1, "test")
    replayed = set()
    for step in range(1, 9):
        s.plan(step, 0.0, 1.0)
        replayed |= s.replays
    assert replayed == {"002"}
    figures = s.figures(8)
    assert math.isinf(figures["001"]["replay_gap_steps"]) and figures["002"]["replay_gap_steps"] <= 2


def test_layers_beyond_the_floor_are_bought_at_their_price_with_the_unseen_cost() -> None:
    """The same allowance buys half as many layers beyond the floor when each is priced at
    twice its timed cost (unseen_cost 1.0) as at its timed cost alone (0.0)."""
    from mscale.hook.checks.coverage import Schedule

    bought = {}
    for unseen in (0.0, 1.0):
        s = Schedule(max_gap_steps=8, replay_share=0.0, replay_max_gap_steps=0, incident_steps=4, unseen_cost=unseen)
        s.add("001", list(range(32)))
        s.s_per_element = 1e-6
        for layer in range(32):
            s.mpus["001"].sizes[layer] = 1000  # 1 ms a layer, timed
        s.plan(0, 0.0205, 1.0)  # 20.5 ms: the floor's 4 layers (4 ms), then 16.5 ms of bought layers
        bought[unseen] = len(s.mpus["001"].planned) - s.mpus["001"].floor
    assert bought == {0.0: 16, 1.0: 8}


def test_replays_rotate_across_mpus_with_their_ceiling() -> None:
    guard, train, _ = job(ChecksumConfig(budget=0.0, replay_max_gap_steps=3))
    replayed: dict[str, list[int]] = {}
    for step in range(9):
        train(1)
        for mid, f in guard.summary()["checksum"].items():
            if f["replayed"]:
                replayed.setdefault(mid, []).append(step)
    assert set(replayed) == {m.mpu_id for m in guard.mpus}
    assert all(b - a <= 3 for steps in replayed.values() for a, b in zip(steps, steps[1:], strict=False))
    assert all(len(s) >= 2 for s in replayed.values())


def test_anomalies_and_agent_gpu_findings_put_mpus_under_suspicion() -> None:
    guard, train, rec = job(ChecksumConfig(budget=0.0, replay_every=0))
    train(1)
    mpus = guard.mpus
    spike = Finding("loss", Reason.GRAD_NORM_SPIKE, Severity.WARNING, "", {"mpu_id": "002"})
    assert suspicions(spike, mpus) == [("002", "grad_norm_spike")]
    loss = Finding("loss", Reason.LOSS_SPIKE_ACTION, Severity.CRITICAL, "", {})
    assert [m for m, _ in suspicions(loss, mpus)] == ["001", "002", "003"]
    xid = {"type": "heal", "action": "swap", "reason": "gpu_xid", "gpu": "2"}
    assert suspicions(xid, mpus) == [("003", "gpu_xid")]  # the text MPU is on simulated GPU 2
    assert suspicions({**xid, "end": True}, mpus) == []
    assert suspicions(Finding("x", Reason.HEAL_ACTION, Severity.INFO, "", {"mpu_id": "001"}), mpus) == []
    guard.emit(Finding("replicas", Reason.REPLICA_DIVERGED, Severity.CRITICAL, "", {"mpu_id": "001"}))
    train(1)
    f = guard.summary()["checksum"]
    assert f["001"]["incident"] == 1.0 and f["001"]["coverage_ratio"] == 1.0 and f["001"]["replayed"] == 1.0
    assert f["002"]["incident"] == 0.0


def test_verdicts_at_the_commit_point_read_back_once_a_step_and_drop_a_failed_update() -> None:
    """verdicts="commit" (the default off a CPU) run on the CPU: no host read in forward or
    backward, one at the optimizer step; a failure found there drops that step's update."""
    guard, train, rec = job(ChecksumConfig(verdicts="commit", full=True, replay_every=1))
    det = guard.checksum
    reads = {"item": 0}
    originals = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "__float__", "__bool__")}

    def counting(name):
        def read(self, *a, **k):
            reads["item"] += 1
            return originals[name](self, *a, **k)

        return read

    model, opt = guard.model, guard.optimizer
    data = SyntheticCaptions(CFG, size=1000, seed=0)
    for step in range(3):
        b = torch.utils.data.default_collate([data[step * 4 + j] for j in range(4)])
        before = det.readbacks
        for n in originals:
            setattr(torch.Tensor, n, counting(n))
        try:
            loss = model(b["images"], b["tokens"])["loss"]
            loss.backward()
        finally:
            for n, f in originals.items():
                setattr(torch.Tensor, n, f)
        assert reads["item"] == 0 and det.readbacks == before  # nothing read inside the step
        opt.step()
        opt.zero_grad()
        assert det.readbacks == before + 1  # one read of the verdicts, at the commit point
    w = guard.mpu("vision").module.layers[0].linear1.weight.detach().clone()
    inject(guard, kind="exponent_flip", mpu="vision", steps=1, seed=2)
    b = torch.utils.data.default_collate([data[40 + j] for j in range(4)])
    model(b["images"], b["tokens"])["loss"].backward()
    opt.step()
    opt.zero_grad()
    assert rec.steps(*FAIL, mpu="vision") == [3]
    assert torch.equal(guard.mpu("vision").module.layers[0].linear1.weight, w)  # the update was dropped


def test_budget_allowance_and_ratio() -> None:
    b = Budget(0.02)
    assert b.allowance_s("checksum") == 0.0  # no step measured yet
    b.charge("checksum", 0.004)
    b.charge("weights", 0.002)
    b.end_step(1.0)
    assert b.last_ratio == pytest.approx(0.006)
    assert b.allowance_s("checksum") == pytest.approx(0.02 - 0.002)
    assert b.allowance_s("weights") == pytest.approx(0.02 - 0.004)
    with b.timer("checksum"):
        sum(range(1000))
    assert b.spent_s["checksum"] > 0
    with pytest.raises(ValueError, match="share"):
        Budget(1.5)


def test_the_plans_aim_below_the_budget_by_its_headroom() -> None:
    """The allowance is the aim, (1 - headroom) x budget x step, less what the others spend: a
    plan never spends the ceiling itself."""
    b = Budget(0.02, headroom=0.25, smoothing=1.0)  # each step's figures as they are
    b.charge("weights", 0.002)
    b.end_step(1.0)
    assert b.allowance_s("checksum") == pytest.approx(0.75 * 0.02 - 0.002)
    assert b.figures()["aim"] == pytest.approx(0.015) and b.figures()["budget"] == 0.02
    b.charge("weights", 0.02)  # the others alone above the aim: nothing left, never below zero
    b.end_step(1.0)
    assert b.allowance_s("checksum") == 0.0
    assert Budget(0.02, headroom=0.0).allowance_s("checksum") == 0.0  # no step measured yet
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="headroom"):
            Budget(0.01, headroom=bad)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"max_gap_steps": 9}, "max_gap_steps"),
        ({"max_gap_steps": 0}, "max_gap_steps"),
        ({"budget": -0.1}, "budget"),
        ({"verdicts": "later"}, "verdicts"),
        ({"incident_steps": 0}, "incident_steps"),
        ({"unseen_cost": -1.0}, "unseen_cost"),
        ({"unseen_cost": float("nan")}, "unseen_cost"),
        ({"headroom": 1.0}, "headroom"),
        ({"headroom": -0.5}, "headroom"),
    ],
)
def test_config_is_range_checked(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        ChecksumConfig(**kw)


class _XW(torch.nn.Module):
    """A linear that is not nn.Linear: y = x w + b, w stored (in, out)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n_in, n_out) / n_in**0.5)
        self.b = torch.nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return x @ self.w + self.b


def test_a_registered_linear_type_is_checked_and_bad_registrations_are_refused() -> None:
    from mscale.hook.checks import linears

    with pytest.raises(TypeError, match="nn.Module subclass"):
        linears.register(int)
    with pytest.raises(ValueError, match="weight"):
        linears.register(_XW, weight="")
    linears.register(_XW, weight="w", bias="b", transposed=True)
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"vision_tower": _XW(8, 8), "language_model": torch.nn.Linear(8, 1)})
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rec = Findings()
    guard = attach(
        model,
        opt,
        job_id="xw",
        connect=False,
        plugins=[rec],
        cmsa=False,
        mpus={"vision": "vision_tower", "text": "language_model"},
        checksum=ChecksumConfig(full=True, replay_every=0),
    )
    on = {"fault": False}
    model["vision_tower"].register_forward_hook(lambda m, a, out: out * 1.5 if on["fault"] else None, prepend=True)
    for step in range(3):
        on["fault"] = step == 2
        x = torch.randn(4, 8)
        guard.model.train()
        model["language_model"](model["vision_tower"](x)).pow(2).mean().backward()
        guard.step()
        opt.zero_grad()
    assert rec.steps(Reason.CHECKSUM_FAILURE, mpu="vision") == [2]


class FakeClock:
    """The budget module's `time`, advanced by hand: costs and step times without timing."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_the_budget_step_runs_from_the_guards_first_forward_and_entries_are_charged_once(monkeypatch) -> None:
    import mscale.hook.checks.budget as budget_mod

    clock = FakeClock()
    monkeypatch.setattr(budget_mod, "time", clock)
    b = Budget(0.01)
    b.step_ended()  # the previous step's end: t = 100
    clock.now = 150.0  # 50 s between steps (data loading, another arm's step) are not the guard's
    b.step_began()
    outer = b.enter("guard")
    clock.now = 151.0
    inner = b.enter("guard")
    b.charge("checksum", 0.25)  # a detector's own charge inside a nested entry
    clock.now = 152.0
    b.leave(inner)  # 1 s, less the 0.25 charged inside
    clock.now = 154.0
    b.leave(outer)  # 4 s, less the inner entry's 1 s in all
    clock.now = 160.0
    b.step_ended()
    assert b.step_s == pytest.approx(10.0)
    assert b.last_spent_s == pytest.approx({"checksum": 0.25, "guard": 3.75})
    assert b.last_ratio == pytest.approx(0.4)
    # an entry open across a step end (the optimizer hook that ends it): its time so far is
    # that step's, the rest the next one's
    b.step_began()
    hook = b.enter("guard")
    clock.now = 163.0
    b.step_ended()
    assert b.last_spent_s == pytest.approx({"guard": 3.0})
    clock.now = 164.0
    b.leave(hook)
    assert b.spent_s == pytest.approx({"guard": 1.0})


def test_a_plugins_work_in_a_step_is_in_the_guards_measured_overhead(monkeypatch) -> None:
    import mscale.hook.checks.budget as budget_mod

    clock = FakeClock()
    monkeypatch.setattr(budget_mod, "time", clock)

    class Slow:  # a plugin whose step end takes 2 s of the fake clock
        def on_step_end(self, step: int, loss) -> None:
            clock.now += 2.0

    guard, train, _ = job()
    guard.add_plugin(Slow())
    train(2)
    # charged through the guard's entry point (the optimizer hook), in the step it ran in (less
    # the detectors' own charges inside it, on the real clock: well under 0.5 s here)
    assert guard.budget.last_spent_s.get("guard", 0.0) >= 1.5
    assert guard.budget.spent_s.get("guard", 0.0) < 1.5
    assert guard.gradients._handles == []  # one rank: no per-parameter hooks in backward


@pytest.mark.parametrize("headroom, bought", [(0.0, True), (0.9999, False)])
def test_the_headroom_decides_what_is_bought_beyond_the_floors_on_a_hf_llava(headroom, bought) -> None:
    """The README's line on a tiny Hugging Face LLaVA, 2 micro-batches a step under bf16
    autocast, the whole step as budget: with no headroom the allowance buys every layer; with
    the aim at 1e-4 of a step (less than the guard's own bookkeeping) it buys none, and each
    step checks the floors, ceil(L / 8) of an MPU's L layers."""
    import mscale
    from support.tiny_hf import Samples, tiny_llava

    model, make_batch = tiny_llava(seed=0)
    loader = mscale.ResumableLoader(Samples(make_batch, 64), batch_size=2, shuffle=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = ChecksumConfig(budget=1.0, headroom=headroom, replay_every=0)
    guard = mscale.attach(
        model,
        opt,
        job_id="aim",
        snapshots=mscale.SnapshotConfig(memory_every=5),
        data=loader,
        connect=False,
        checksum=cfg,
    )
    batches, seen = iter(loader), []
    for _ in range(6):
        for _ in range(2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(**next(batches)).loss / 2
            loss.backward()
        opt.step()
        opt.zero_grad()
        seen.append({mid: f["coverage_ratio"] for mid, f in guard.checksum.figures().items()})
    layers = {mid: len(r.layers) for mid, r in guard.checksum.schedule.mpus.items()}
    guard.detach()
    assert all(n > 0 for n in layers.values())
    floors = {mid: -(-n // 8) / n for mid, n in layers.items()}
    # step 0 checks every layer as it is first seen, step 1 plans before a cost is measured
    for coverage in seen[2:]:
        assert coverage == ({mid: 1.0 for mid in layers} if bought else floors)
