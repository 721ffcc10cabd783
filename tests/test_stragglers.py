"""Slow ranks and slow MPUs (mscale.daemon.stragglers): real DDP ranks reporting to a real agent,
one slowed in its vision tower by the job's own forward hook, and the comparison on its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mscale.daemon.config import ConfigError, load
from mscale.daemon.jobs import JobState
from mscale.daemon.state import AgentState
from mscale.daemon.stragglers import SOURCE, StragglerSection, StragglerWatch
from mscale.findings import Reason
from mscale.link import MpuInfo, Register, StepReport
from support import REPO, free_port
from support.link_agent import FEATURES, Agent, metric, wait_for

JOB = "straggler-job"
SLOW_RANK, SLOW_FROM = 2, 10


def run_job(tmp_path: Path, agent: Agent, steps: int, **slow: object) -> list[dict]:
    out = tmp_path / "out"
    out.mkdir()
    argv = [sys.executable, "tests/support/straggler_job.py", "--world", "4", "--port", str(free_port()),
            "--socket", agent.socket_path, "--out", str(out), "--job", JOB, "--steps", str(steps)]  # fmt: skip
    for k, v in slow.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    log = tmp_path / "job.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the ranks too
            proc.wait(timeout=10)
            raise AssertionError("the job timed out:\n" + log.read_text()[-3000:]) from None
    assert code == 0, log.read_text()[-3000:]
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(4)]


def stragglers(agent: Agent) -> list:
    return [f for _, f in agent.state.events.since(0, 100000) if f.source == SOURCE]


# Four ranks share this machine's two cores with other work (load 10+): a rank descheduled inside
# a forward loses milliseconds, for a while. The ratio and the excess that count are raised above
# that; the slowdown (50 ms in every vision forward, 1 ms without) is far more.
SECTION = StragglerSection(ratio=2.0, min_excess_s=0.02)


@pytest.fixture
def agent(tmp_path: Path):
    a = Agent(
        str(tmp_path / "run" / "agent.sock"),
        {"node": "node-a"},
        features=(*FEATURES, "mscale.daemon.stragglers"),
        sections={"stragglers": SECTION},
    )
    yield a
    a.stop()


@pytest.mark.slow
def test_a_rank_slowed_in_its_vision_tower_is_found_and_named(tmp_path: Path, agent: Agent) -> None:
    window = SECTION.window_steps
    ranks = run_job(tmp_path, agent, 60, slow_rank=SLOW_RANK, slow_from=SLOW_FROM, slow_s=0.05)
    assert [r["steps"] for r in ranks] == [60] * 4
    job = agent.state.jobs[JOB]
    wait_for(lambda: all(rs.step == 59 for rs in job.rank_states.values()), 30, "every report")
    # the agent compares a step once its last report is in: wait for that, not only the reports
    compared = "mscale_straggler_steps_compared_total"
    wait_for(lambda: f"\n{compared} 60.0" in agent.metrics(), 30, "the last step's comparison")
    found = [f for f in stragglers(agent) if f.reason is not Reason.STRAGGLER_CLEARED]
    named = {(f.labels["rank"], f.labels["mpu_id"], f.labels["phase"]) for f in found}
    # the vision MPU's forward, and so the rank's compute; nothing else, no other rank
    assert named == {(str(SLOW_RANK), "001", "forward"), (str(SLOW_RANK), "", "compute")}, found
    vision = next(f for f in found if f.labels["mpu_id"] == "001")
    assert vision.reason is Reason.MPU_STRAGGLER
    assert vision.labels["mpu"] == "vision" and vision.labels["local_rank"] == str(SLOW_RANK)
    assert vision.labels["gpu"] == str(SLOW_RANK) and vision.labels["node"] == "node-a" == ranks[0]["node"]
    assert vision.labels["job_id"] == JOB
    assert SLOW_FROM <= int(vision.labels["step"]) < SLOW_FROM + window  # found within the window
    assert float(vision.labels["ratio"]) > SECTION.ratio
    text = agent.metrics()
    lab = f'job_id="{JOB}",local_rank="{SLOW_RANK}",mpu="vision",mpu_id="001",phase="forward",rank="{SLOW_RANK}"'
    assert metric(text, f'mscale_straggler{{gpu="{SLOW_RANK}",gpu_uuid="",{lab}}}') == 1
    assert metric(text, f"mscale_straggler_ratio{{{lab}}}") > SECTION.ratio
    fast = f'job_id="{JOB}",local_rank="0",mpu="vision",mpu_id="001",phase="forward",rank="0"'
    assert metric(text, f'mscale_straggler{{gpu="0",gpu_uuid="",{fast}}}') == 0
    assert metric(text, "mscale_straggler_findings_total") == 2
    assert metric(text, compared) == 60


@pytest.mark.slow
def test_no_slowdown_gives_no_finding_in_300_steps(tmp_path: Path, agent: Agent) -> None:
    ranks = run_job(tmp_path, agent, 300)
    assert [r["steps"] for r in ranks] == [300] * 4
    job = agent.state.jobs[JOB]
    wait_for(lambda: all(rs.step == 299 for rs in job.rank_states.values()), 30, "every report")
    compared = "mscale_straggler_steps_compared_total"
    wait_for(lambda: f"\n{compared} 300.0" in agent.metrics(), 30, "the last step's comparison")
    assert stragglers(agent) == []
    text = agent.metrics()
    assert metric(text, compared) == 300  # every step was compared
    assert metric(text, "mscale_straggler_findings_total") == 0
    assert text.count("mscale_straggler{") == 4 * (1 + 3 * 2)  # per rank: compute, 3 MPUs x 2 phases


# --- the comparison on its own: reports as the link hands them over -------------------------


def _job(state: AgentState, ranks: int = 4) -> JobState:
    job = JobState(job_id="j")
    for r in range(ranks):
        job.register(Register(job_id="j", rank=r, pid=100 + r, local_rank=r, world_size=ranks,
                              mpus=(MpuInfo("001", "vision", r), MpuInfo("002", "text", r))))  # fmt: skip
        job.ranks[r] = 100 + r
    state.jobs["j"] = job
    return job


def _step(watch: StragglerWatch, job: JobState, step: int, vision: dict[int, float]) -> None:
    for r in sorted(job.ranks):
        rep = {"step": step, "mpus": {"001": {"forward_s": vision.get(r, 0.010), "backward_s": 0.020},
                                      "002": {"forward_s": 0.010, "backward_s": 0.020}}}  # fmt: skip
        watch.observe(job, r, StepReport.from_wire(rep))


def test_one_slow_step_is_not_a_straggler_and_a_held_one_is_then_clears() -> None:
    state = AgentState(node="n")
    job = _job(state)
    watch = StragglerWatch(StragglerSection(window_steps=10, warmup_steps=0, evaluate_every_steps=1), state)
    for s in range(30):  # every third step slow: never half the window
        _step(watch, job, s, {1: 0.050} if s % 3 == 0 else {})
    assert [f for _, f in state.events.since()] == []
    for s in range(30, 60):
        _step(watch, job, s, {1: 0.050})
    found = [f for _, f in state.events.since()]
    # the window 27..36 is the first with 8 slow steps (27, 30..36): its lower quartile is slow
    assert [(f.reason, f.labels["step"], f.labels["mpu_id"], f.labels["phase"]) for f in found] == [
        (Reason.RANK_STRAGGLER, "36", "", "compute"),
        (Reason.MPU_STRAGGLER, "36", "001", "forward"),
    ]
    assert (found[1].labels["rank"], found[1].labels["mpu"], found[1].labels["gpu"]) == ("1", "vision", "1")
    assert found[1].labels["ratio"] == "5.000" and found[1].labels["seconds"] == "0.050000"
    for s in range(60, 80):
        _step(watch, job, s, {})
    assert [f.reason for _, f in state.events.since()][2:] == [Reason.STRAGGLER_CLEARED] * 2
    assert watch.findings_total == 2
    view = watch.view()
    assert not any(s.straggler for s in view.figures) and view.steps_compared == 80


def test_a_step_is_compared_once_every_live_rank_reported_it_and_odd_figures_are_skipped() -> None:
    state = AgentState(node="n")
    job = _job(state, ranks=3)
    watch = StragglerWatch(StragglerSection(), state)
    watch.observe(job, 0, StepReport.from_wire({"step": 0, "mpus": {"001": {"forward_s": 0.01}}}))
    watch.observe(job, 1, StepReport.from_wire({"step": 0, "mpus": {"001": {"forward_s": "nan", "backward_s": -1}}}))
    assert watch.steps_compared == 0  # rank 2 has not reported step 0
    job.ranks.pop(2)  # rank 2 left: the others are the job now
    watch.observe(job, 0, StepReport.from_wire({"step": 1, "mpus": {"001": {"forward_s": 0.01}}}))
    assert watch.steps_compared == 0
    watch.observe(job, 1, StepReport.from_wire({"step": 1, "mpus": {"001": {"forward_s": 0.01}}}))
    assert watch.steps_compared == 1  # step 1; step 0, never whole, is dropped with it
    assert watch.boards["j"].pending == {}
    del state.jobs["j"]
    assert watch.view().figures == ()
    assert watch.boards == {}  # an expired job's comparison goes with it


def test_a_rank_whose_reports_come_in_a_burst_far_ahead_still_has_every_step_compared() -> None:
    # one rank's 200 steps arrive before any other rank's (its client's batches reached the agent
    # first): the steps are held by number, so each is compared once the others report it
    state = AgentState(node="n")
    job = _job(state, ranks=3)
    watch = StragglerWatch(StragglerSection(window_steps=10, warmup_steps=0, evaluate_every_steps=1), state)
    rep = {"mpus": {"001": {"forward_s": 0.010, "backward_s": 0.020}}}
    for s in range(200):
        watch.observe(job, 0, StepReport.from_wire({"step": s, **rep}))
    assert watch.steps_compared == 0
    for r in (1, 2):
        for s in range(200):
            watch.observe(job, r, StepReport.from_wire({"step": s, **rep}))
    assert watch.steps_compared == 200
    assert watch.boards["j"].pending == {}


def test_the_section_refuses_a_ratio_that_cannot_mean_slow(tmp_path: Path) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text("[stragglers]\nwindow_steps = 30\n")
    assert load(cfg).stragglers.window_steps == 30
    cfg.write_text("[stragglers]\nratio = 0.5\n")
    with pytest.raises(ConfigError, match=r"stragglers\.ratio"):
        load(cfg)


def test_a_slow_mpu_is_recorded_by_default_and_swapped_only_where_the_policy_says(tmp_path: Path) -> None:
    from mscale.healing import policy as policymod
    from mscale.healing.engine import Condition, HealingEngine, Target
    from mscale.healing.settings import HealingSection

    def tgt(rule, cond):
        return [Target("j", "001", 2)]

    slow = Condition(
        kind="reason", name="mpu_straggler", labels={"job_id": "j", "mpu_id": "001", "gpu": "2"}, severity="warning"
    )
    shipped = policymod.load("")
    assert shipped.match("reason", "mpu_straggler").name == "mpu_straggler"
    assert HealingEngine(shipped, HealingSection(), emit=lambda f: None).decide(slow, tgt) == []
    text = (REPO / "mscale" / "healing" / "policy.yaml").read_text()
    rule = "    reasons: [mpu_straggler]\n    target: mpu\n    actions: {any: []}"
    assert rule in text
    mine = tmp_path / "policy.yaml"
    mine.write_text(text.replace(rule, rule.replace("{any: []}", "{healthy: [l1_swap]}")))
    (d,) = HealingEngine(policymod.load(str(mine)), HealingSection(), emit=lambda f: None).decide(slow, tgt)
    assert (d.action, d.target.mpu_id) == ("l1_swap", "001")
