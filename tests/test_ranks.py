"""Eight ranks of one job on one node: the agent keeps a state per (job, rank), per-rank series
carry `rank` and `local_rank`, job-level series are aggregated on purpose (step: the minimum,
loss: rank 0's, reports: summed), and `mscale status` and /api/v1/status show every rank.
The ranks are real processes reporting through the hook library's link client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mscale.agent_client import AgentClient
from mscale.daemon.exporters import jobs as jobs_exporter
from mscale.daemon.jobs import JobState, RankLimit
from mscale.daemon.state import AgentState
from mscale.daemon.status_cli import render
from mscale.link import MpuInfo, Register, StepReport
from support import REPO
from support.link_agent import Agent, metric, wait_for

JOB = "job-8"
RANKS, STEPS = 8, 6  # rank i trains STEPS + i steps: 0..STEPS+i-1


def _trained(out: Path, n: int, timeout_s: float) -> dict[int, tuple[int, float]]:
    """Each rank's (last step, loss), once all n have written theirs."""
    wait_for(lambda: len(list(out.glob("rank_*"))) == n, timeout_s, f"{n} ranks trained")
    rows = [f.read_text().split() for f in out.glob("rank_*")]
    return {int(r): (int(step), float(loss)) for r, step, loss in rows}


@pytest.mark.slow
def test_eight_ranks_of_one_job_are_kept_and_exported_per_rank(tmp_path: Path) -> None:
    sock = str(tmp_path / "run" / "agent.sock")
    stop, out = tmp_path / "stop", tmp_path / "out"
    out.mkdir()
    agent = Agent(sock)
    log = open(tmp_path / "ranks.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "tests/support/rank_job.py", "--socket", sock, "--job", JOB, "--ranks", str(RANKS),
         "--steps", str(STEPS), "--stop", str(stop), "--out", str(out)],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        trained = _trained(out, RANKS, 480)
        assert {r: s for r, (s, _) in trained.items()} == {r: STEPS + r - 1 for r in range(RANKS)}
        job = wait_for(lambda: agent.state.jobs.get(JOB), what="registration")
        wait_for(lambda: job.reports_total == sum(STEPS + r for r in range(RANKS)), 60, "every rank's reports")
        assert sorted(job.rank_states) == list(range(RANKS)) and sorted(job.ranks) == list(range(RANKS))
        for r, rs in job.rank_states.items():
            assert (rs.rank, rs.local_rank, rs.world_size, rs.step) == (r, r, RANKS, STEPS + r - 1)
            assert {m.gpu for m in rs.mpus.values()} == {r}  # each rank's MPUs on its own GPU
            assert rs.loss == pytest.approx(trained[r][1], rel=1e-6)
        assert job.step == STEPS - 1  # the slowest rank
        assert job.loss == pytest.approx(trained[0][1], rel=1e-6)  # as rank 0 reports it
        assert trained[0][1] != pytest.approx(trained[1][1], rel=1e-6)  # (so the choice shows)

        text = agent.metrics()
        assert metric(text, f'mscale_job_ranks{{job_id="{JOB}"}}') == RANKS
        assert metric(text, f'mscale_job_step{{job_id="{JOB}"}}') == STEPS - 1
        assert metric(text, f'mscale_job_loss{{job_id="{JOB}"}}') == pytest.approx(trained[0][1], rel=1e-6)
        assert metric(text, f'mscale_job_reports_total{{job_id="{JOB}"}}') == sum(STEPS + r for r in range(RANKS))
        for r in range(RANKS):
            lab = f'job_id="{JOB}",local_rank="{r}"'
            assert metric(text, f'mscale_job_up{{{lab},rank="{r}"}}') == 1
            assert metric(text, f'mscale_job_rank_step{{{lab},rank="{r}"}}') == STEPS + r - 1
            for mpu_id, name in (("001", "vision"), ("002", "aligner"), ("003", "text")):
                for phase in ("forward", "backward"):
                    score = metric(
                        text, f'mpu_health_score{{{lab},mpu="{name}",mpu_id="{mpu_id}",phase="{phase}",rank="{r}"}}'
                    )
                    assert 0 <= score <= 100
        assert text.count("mpu_health_score{") == RANKS * 3 * 2
        assert text.count("mscale_mpu_info{") == RANKS * 3

        view = AgentClient(f"http://127.0.0.1:{agent.port}", timeout=10).status(events=50)
        (vjob,) = view["jobs"]
        assert vjob["step"] == STEPS - 1 and [r["rank"] for r in vjob["ranks"]] == list(range(RANKS))
        assert all(len(r["mpus"]) == 3 and r["connected"] for r in vjob["ranks"])
        registered = [e for e in view["events"] if e["reason"] == "job_registered"]
        assert sorted(int(e["labels"]["rank"]) for e in registered) == list(range(RANKS))
        shown = render(view)
        assert "RANK" in shown.splitlines()[shown.splitlines().index("no GPU data") + 2]
        assert len([ln for ln in shown.splitlines() if ln.startswith(JOB + " ")]) == RANKS * 3

        cli = subprocess.run(
            [sys.executable, "-m", "mscale", "status", "--agent", f"http://127.0.0.1:{agent.port}"],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        assert f"{JOB}: step {STEPS - 1} (slowest rank), {RANKS} ranks" in cli.stdout
    finally:
        stop.touch()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the ranks too
            proc.wait(timeout=10)
        log.close()
        agent.stop()
    assert proc.returncode == 0, (tmp_path / "ranks.log").read_text()[-3000:]
    wait_for(lambda: not job.ranks, 30, "every rank disconnected")
    assert all(not rs.connected for rs in job.rank_states.values())


def _reg(rank: int, pid: int) -> Register:
    return Register(job_id="j", rank=rank, pid=pid, mpus=(MpuInfo("001", "vision", rank),))


def test_the_rank_table_is_bounded_and_a_gone_rank_makes_room() -> None:
    job = JobState(job_id="j", max_ranks=2)
    job.register(_reg(0, 10))
    job.register(_reg(1, 11))
    job.ranks = {0: 10, 1: 11}
    with pytest.raises(RankLimit, match="holds 2 ranks"):
        job.register(_reg(2, 12))
    assert sorted(job.rank_states) == [0, 1]  # nothing changed
    job.ranks.pop(1)
    job.disconnect(1)
    job.register(_reg(2, 12))
    assert sorted(job.rank_states) == [0, 2]


def test_job_figures_are_aggregated_on_purpose() -> None:
    job = JobState(job_id="j")
    for r in (0, 1, 2):
        job.register(_reg(r, 10 + r))
        job.ranks[r] = 10 + r
    job.apply_report(StepReport(step=7, loss=1.5, skipped=True), {}, rank=0)
    job.apply_report(StepReport(step=5, loss=9.0), {}, rank=1)
    job.apply_report(StepReport(step=9, loss=4.0), {}, rank=2)
    assert (job.step, job.loss, job.reports_total, job.steps_skipped) == (5, 1.5, 3, 1)
    job.ranks.pop(1)  # a rank that left no longer holds the job back
    assert job.step == 7
    job.ranks.pop(0)  # rank 0 gone: the lowest live rank speaks for the job
    assert (job.lead, job.loss) == (2, 4.0)
    assert [(rs.rank, m.gpu) for rs, m in job.iter_mpus()] == [(0, 0), (1, 1), (2, 2)]


def test_a_gpu_snapshot_rescores_the_mpus_on_it_and_a_scrape_only_reads() -> None:
    """Health is scored when a report arrives and when the GPU probe publishes, never at a
    scrape (issue 24: the scrape only reads)."""
    state = AgentState(node="n")
    job = state.jobs["j"] = JobState(job_id="j")
    job.register(_reg(0, 10))
    job.ranks[0] = 10
    (_, mpu), *_ = job.iter_mpus()
    assert mpu.health_score == 100.0
    state.publish("gpu", SimpleNamespace(gpus=(SimpleNamespace(index=0, uuid="GPU-0", health="degraded"),)))
    assert (mpu.health_score, mpu.gpu_uuid) == (75.0, "GPU-0")
    mpu.health_score = -1.0  # a scrape must leave the score as it is
    list(jobs_exporter.collect(state))
    assert mpu.health_score == -1.0


def test_the_host_probe_measures_every_live_rank_of_a_job() -> None:
    """A job of two ranks here: both processes are measured (not only the first rank's)."""
    from mscale.probes.host import HostProbe

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        job = JobState(job_id="j")
        job.register(_reg(0, os.getpid()))
        job.register(_reg(1, child.pid))
        job.ranks = {0: os.getpid(), 1: child.pid}
        assert job.pids == sorted([os.getpid(), child.pid])
        snap = HostProbe(jobs=lambda: [job]).sample()
        assert sorted(p.pid for p in snap.processes) == job.pids and {p.job_id for p in snap.processes} == {"j"}
    finally:
        child.stdin.close()
        child.wait(10)
