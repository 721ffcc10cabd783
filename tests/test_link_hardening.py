"""Issue 16 on the hook socket: every message schema-checked (a bad one refused with an error
frame, counted, changing nothing), job state bounded (expiry, caps on jobs, ranks, MPUs, event
history bytes), job identity bound to the uid that registered it, `allowed_uids` integers only,
and `mscale status` printing no terminal escapes from job-supplied strings. A real agent app
on a real Unix socket; other users and other processes are real processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mscale import link as protocol
from mscale.daemon.config import ConfigError, load
from mscale.daemon.state import EventLog, finding_bytes
from mscale.findings import Finding, Reason, Severity
from mscale.link import BadMessage
from support import REPO, require
from support.fuzz import json_values
from support.link_agent import Agent, RawLink, metric, wait_for


def mpus(n: int) -> list[dict]:
    return [{"mpu_id": f"{i + 1:03d}", "name": f"m{i}", "gpu": i % 8, "params": 10} for i in range(n)]


def reg(job_id: str = "job-1", rank: int = 0, n: int = 2, **extra) -> dict:
    return {"type": "register", "job_id": job_id, "rank": rank, "pid": 1, "step": 0, "mpus": mpus(n), **extra}


def answer(reply) -> dict:
    assert isinstance(reply, str), f"connection ended: {reply}"
    return json.loads(reply)


@pytest.fixture
def sock(tmp_path: Path) -> str:
    return str(tmp_path / "run" / "agent.sock")


@pytest.fixture
def shared_dir():
    """A socket directory another user can reach (pytest's tmp_path is not)."""
    tmp = tempfile.mkdtemp(prefix="mscale-link-")
    os.chmod(tmp, 0o755)
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


# --- item 3: one bad message changes nothing and breaks nothing ------------------------------


@pytest.mark.parametrize(
    "frame,words",
    [
        # the cases: params a string, params 1e400 (a float infinity once parsed)
        (json.dumps(reg(mpus=[{"mpu_id": "001", "name": "v", "gpu": 0, "params": "x"}])), "params"),
        (json.dumps(reg()).replace('"params": 10', '"params": 1e400', 1), "params"),
        (json.dumps(reg(step=10**400)), "step"),
        (json.dumps(reg(rank=10**400)), "rank"),
        (json.dumps(reg(colour="red")), "unknown field"),
        (json.dumps(reg(mpus=[{"mpu_id": "001", "name": "\x1b[2Jv", "gpu": 0}])), "name"),
        (json.dumps(reg(mpus=[{"mpu_id": "0 1", "name": "v", "gpu": 0}])), "mpu_id"),
        ("[" * 100_000, "nested too deep"),
    ],
)
def test_a_bad_register_is_refused_counted_and_leaves_no_ghost_job(sock: str, frame: str, words: str) -> None:
    agent = Agent(sock)
    raw = RawLink(sock)
    try:
        got = answer(raw.ask(frame))
        assert got["type"] == "error" and words in got["error"], got
        assert agent.state.refused[("socket", "malformed")] == 1
        assert agent.state.jobs == {}
        text = agent.metrics()
        assert "mscale_job_up{" not in text and "mpu_health_score{" not in text
        assert metric(text, 'mscale_refused_messages_total{where="socket",why="malformed"}') == 1
        # the connection goes on: a valid registration on it is taken
        assert answer(raw.ask(json.dumps(reg())))["type"] == "registered"
        assert 'mscale_job_up{job_id="job-1",local_rank="0",rank="0"} 1.0' in agent.metrics()
    finally:
        raw.close()
        agent.stop()


@pytest.mark.parametrize(
    "change",
    [
        {"step": 10**400},  # the case: made every scrape fail with OverflowError
        {"step": 1, "mpus": {"001": {"checksum_consecutive_failures": 10**400}}},  # the other one
        {"step": 1, "loss": 10**400},
        {"step": 1, "time": -5},
        {"step": 1, "mpus": {"001": {"gpu": True}}},
        {"step": 1, "findings": [{}] * (protocol.MAX_FINDINGS + 1)},
        {"step": 1, "extra": 1},
    ],
)
def test_a_bad_report_is_refused_and_every_scrape_still_works(sock: str, change: dict) -> None:
    agent = Agent(sock)
    raw = RawLink(sock)
    try:
        assert answer(raw.ask(json.dumps(reg())))["type"] == "registered"
        good = {"type": "report", "job_id": "job-1", "dropped": 0, "reports": [{"step": 3, "loss": 1.5}]}
        raw.send(json.dumps(good))  # a report taken has no answer
        wait_for(lambda: agent.state.jobs["job-1"].step == 3, what="the good report")
        before = agent.state.jobs["job-1"].to_dict()
        got = answer(raw.ask(json.dumps({**good, "reports": [change]})))
        assert got["type"] == "error"
        assert agent.state.refused[("socket", "malformed")] == 1
        assert agent.state.jobs["job-1"].to_dict() == before
        text = agent.metrics()
        assert metric(text, 'mscale_job_step{job_id="job-1"}') == 3
    finally:
        raw.close()
        agent.stop()


def test_an_oversized_message_gets_its_error_frame_and_the_connection_goes_on(sock: str) -> None:
    agent = Agent(sock, max_message_bytes=4096)
    raw = RawLink(sock)
    try:
        got = answer(raw.ask(json.dumps(reg(job_id="x" * 10, mpus=mpus(1), pad="y" * 6000))))
        assert got["type"] == "error" and "socket.max_message_bytes" in got["error"]
        assert agent.state.refused[("socket", "oversized")] == 1 and agent.state.jobs == {}
        assert answer(raw.ask(json.dumps(reg())))["type"] == "registered"
        # past twice the limit a frame cannot be read at all: closed with 1009 (too big), counted
        assert raw.ask("z" * 9000) in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING)
        assert raw.close_code == 1009
        wait_for(lambda: agent.state.refused[("socket", "oversized")] == 2, what="the second oversized count")
    finally:
        raw.close()
        agent.stop()


# fuzz: a message built from a valid one with one field replaced by anything JSON can carry
JSON = json_values(int_bound=10**400, nan=True, infinity=True)
REG_PATHS = [("job_id",), ("rank",), ("pid",), ("step",), ("mpus",), ("extra",)] + [
    ("mpus", 0, k) for k in ("mpu_id", "name", "gpu", "gpu_uuid", "path", "device", "fuse_level", "params", "x")
]
REPORT_PATHS = (
    [("dropped",), ("reports",), ("reports", 0)]
    + [("reports", 0, k) for k in ("step", "time", "loss", "grad_norm", "skipped", "mpus", "findings", "x")]
    + [
        ("reports", 0, "mpus", "001", k)
        for k in (
            "forward_s",
            "gvc",
            "checksum_ok",
            "checksum_consecutive_failures",
            "checksum_failures_total",
            "gpu",
            "fuse_level",
            "memory_used_bytes",
            "x",
        )
    ]
    + [("reports", 0, "findings", 0, k) for k in ("source", "reason", "severity", "message", "labels", "time")]
)


def mutated(msg: dict, path: tuple, value) -> dict:
    msg = json.loads(json.dumps(msg))
    node = msg
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return msg


def _state(agent: Agent) -> tuple:
    jobs = {k: (j.to_dict(), sorted(j.findings.items()), j.uid, j.ranks) for k, j in sorted(agent.state.jobs.items())}
    return repr(jobs), agent.state.events.since(0)[-1:]  # (repr: NaN equals NaN there)


@pytest.fixture(scope="module")
def fuzz_agent(tmp_path_factory):
    sock = str(tmp_path_factory.mktemp("fuzz") / "agent.sock")
    agent = Agent(sock)
    raw = RawLink(sock)
    assert answer(raw.ask(json.dumps(reg(job_id="fuzz"))))["type"] == "registered"
    yield agent, raw
    raw.close()
    agent.stop()


@given(path=st.sampled_from(REG_PATHS), value=JSON)
def test_fuzz_register_refused_cleanly_or_taken(fuzz_agent, path, value) -> None:
    agent, raw = fuzz_agent
    frame = json.dumps(mutated(reg(job_id="fuzz"), path, value))
    before, refused = _state(agent), sum(agent.state.refused.values())
    reply = answer(raw.ask(frame))
    if reply["type"] == "error":
        assert sum(agent.state.refused.values()) == refused + 1
        assert _state(agent) == before, "a refused registration changed the agent's state"
    else:
        assert reply == {"type": "registered", "job_id": "fuzz", "node": agent.state.node}
        protocol.Register.from_wire(json.loads(frame))
    assert "mscale_job_up{" in agent.metrics()


GOOD_REPORT = {
    "type": "report",
    "job_id": "fuzz",
    "dropped": 0,
    "reports": [
        {
            "step": 5,
            "time": 1.0,
            "loss": 2.0,
            "grad_norm": "nan",
            "skipped": False,
            "mpus": {"001": {"forward_s": 0.1, "checksum_ok": True, "gpu": 0}},
            "findings": [
                Finding("loss", Reason.LOSS_SPIKE_WARN, Severity.WARNING, "m", {"a": "b"}, time=1.0).to_dict()
            ],
        }
    ],
}


@given(path=st.sampled_from(REPORT_PATHS), value=JSON)
def test_fuzz_report_refused_cleanly_or_taken(fuzz_agent, path, value) -> None:
    agent, raw = fuzz_agent
    frame = json.dumps(mutated(GOOD_REPORT, path, value))
    before, refused = _state(agent), sum(agent.state.refused.values())
    if _refused_now(frame):
        reply = answer(raw.ask(frame))
        assert reply["type"] == "error" and reply["error"]
        assert sum(agent.state.refused.values()) == refused + 1
        assert _state(agent) == before, "a refused report changed the agent's state"
    else:
        # a report taken has no answer; the unknown type sent after it always has one
        raw.send(frame)
        marker = answer(raw.ask(json.dumps({"type": "fuzz-marker"})))
        assert marker["type"] == "error" and "fuzz-marker" in marker["error"], marker
        job = agent.state.jobs["fuzz"]
        assert -1 <= job.step <= protocol.MAX_INT  # -1: no step reported yet
    assert "mscale_job_step{" in agent.metrics()


def _refused_now(frame: str) -> bool:
    """Whether the protocol refuses this report as a whole (it then gets an error frame)."""
    try:
        protocol.Report.from_wire(protocol.decode(frame))
    except BadMessage:
        return True
    return False


@given(st.text(max_size=200) | st.binary(max_size=200).map(lambda b: b.decode("latin-1")))
def test_fuzz_decode_refuses_or_returns_a_typed_object(text) -> None:
    try:
        msg = protocol.decode(text, 4096)
    except BadMessage as e:
        assert e.why in ("malformed", "oversized") and str(e)
    else:
        assert isinstance(msg, dict) and isinstance(msg["type"], str)


# --- item 4: bounded state -------------------------------------------------------------------


@pytest.mark.slow  # 300 connections: about 2 s
def test_register_then_disconnect_64_mpus_300_times_does_not_grow_metrics(sock: str) -> None:
    agent = Agent(sock, job_expiry_s=0.3)
    try:
        baseline = len(agent.metrics())
        for i in range(300):
            raw = RawLink(sock)
            assert answer(raw.ask(json.dumps(reg(job_id=f"churn-{i}", n=64))))["type"] == "registered"
            raw.close()
        wait_for(lambda: not agent.state.jobs, timeout_s=60, what="every disconnected job to expire")
        text = agent.metrics()
        assert "churn-" not in text
        assert len(text) < baseline + 2000, (baseline, len(text))
        assert metric(text, "mscale_jobs_expired_total") == 300
    finally:
        agent.stop()


def test_caps_on_jobs_ranks_and_mpus_refused_and_counted(sock: str) -> None:
    agent = Agent(sock, max_jobs=2, max_ranks_per_job=2, max_mpus_per_job=4)
    links = [RawLink(sock) for _ in range(5)]
    try:
        a0, a1, a2, b0, c0 = links
        assert answer(a0.ask(json.dumps(reg("a", 0))))["type"] == "registered"
        assert answer(a1.ask(json.dumps(reg("a", 1))))["type"] == "registered"
        got = answer(a2.ask(json.dumps(reg("a", 2))))
        assert got["type"] == "error" and "max_ranks_per_job" in got["error"]
        got = answer(b0.ask(json.dumps(reg("b", 0, n=5))))
        assert got["type"] == "error" and "max_mpus_per_job" in got["error"]
        assert answer(b0.ask(json.dumps(reg("b", 0, n=4))))["type"] == "registered"
        got = answer(c0.ask(json.dumps(reg("c", 0))))
        assert got["type"] == "error" and "max_jobs" in got["error"]
        refused = agent.state.refused
        assert [refused[("socket", w)] for w in ("rank_limit", "mpu_limit", "job_limit")] == [1, 1, 1]
        assert sorted(agent.state.jobs) == ["a", "b"] and sorted(agent.state.jobs["a"].ranks) == [0, 1]
        # a disconnected job makes room for a new one before it expires
        b0.close()
        wait_for(lambda: not agent.state.jobs["b"].connected, what="b to leave")
        assert answer(c0.ask(json.dumps(reg("c", 0))))["type"] == "registered"
        assert sorted(agent.state.jobs) == ["a", "c"]
        text = agent.metrics()
        assert 'why="job_limit"} 1.0' in text and 'job_id="b"' not in text
    finally:
        for raw in links:
            raw.close()
        agent.stop()


def test_event_history_is_bounded_in_bytes_as_well_as_count() -> None:
    log = EventLog(maxlen=1000, max_bytes=1 << 16)
    for i in range(200):
        log.emit(Finding("hook:x", Reason.LOSS_SPIKE_WARN, Severity.INFO, "m" * 10_000, {"i": str(i)}))
    kept = log.since(0)
    assert log.bytes <= 1 << 16 and log.bytes == sum(finding_bytes(f) for _, f in kept)
    assert 1 <= len(kept) < 10 and kept[-1][1].labels["i"] == "199"  # the newest kept, oldest gone
    assert log.counts[("hook:x", "loss_spike_warn", "info")] == 200  # the counter still counts every one
    small = EventLog(maxlen=10)
    for _ in range(25):
        small.emit(Finding("a", Reason.LOSS_SPIKE_WARN, Severity.INFO, "m"))
    assert len(small.since(0)) == 10


# --- item 5: job identity bound to a uid -----------------------------------------------------

CLIENT = """
import asyncio, json, os, sys, aiohttp
uid = int(sys.argv[2])
if uid != os.getuid():
    os.setgid(uid); os.setuid(uid)
async def main():
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sys.argv[1])) as s:
        async with s.ws_connect("http://localhost/v1/link") as ws:
            for frame in json.loads(sys.argv[3]):
                await ws.send_str(json.dumps(frame))
                msg = await ws.receive(timeout=10)
                print(msg.data if msg.type == aiohttp.WSMsgType.TEXT else "closed", flush=True)
asyncio.run(main())
"""


def client(sock: str, uid: int, frames: list[dict]) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-c", CLIENT, sock, str(uid), json.dumps(frames)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_another_uid_cannot_take_over_a_job(shared_dir: str) -> None:
    require(os.getuid() == 0, "needs root to run a peer as another user")
    sock = os.path.join(shared_dir, "agent.sock")
    agent = Agent(sock, mode=0o666, allowed_uids=[65534])
    owner = RawLink(sock)
    try:
        assert answer(owner.ask(json.dumps(reg("victim"))))["type"] == "registered"
        forged = {
            "type": "report",
            "job_id": "victim",
            "reports": [
                {
                    "step": 999,
                    "findings": [
                        Finding("checksum", Reason.CHECKSUM_L1_TRIGGER, Severity.CRITICAL, "forged").to_dict()
                    ],
                }
            ],
        }
        got = client(sock, 65534, [reg("victim"), forged])
        assert got[0]["type"] == "error" and "belongs to another user" in got[0]["error"]
        assert got[1]["type"] == "error" and "register first" in got[1]["error"]
        assert agent.state.refused[("socket", "job_owner")] == 1
        job = agent.state.jobs["victim"]
        assert job.uid == 0 and job.connected and job.step == -1
        assert not any(f.reason is Reason.CHECKSUM_L1_TRIGGER for _, f in agent.state.events.since(0))
        # the owner's connection is untouched; the other user may register a job of its own
        assert answer(owner.ask(json.dumps({"type": "teleport"})))["type"] == "error"
        assert client(sock, 65534, [reg("mine")])[0]["type"] == "registered"
        assert agent.state.jobs["mine"].uid == 65534
    finally:
        owner.close()
        agent.stop()


def test_a_second_live_registration_of_a_job_rank_is_refused_not_a_takeover(sock: str) -> None:
    agent = Agent(sock)
    first = RawLink(sock)
    try:
        assert answer(first.ask(json.dumps(reg("j", 0))))["type"] == "registered"
        pid = agent.state.jobs["j"].ranks[0]
        assert pid == os.getpid()
        # another process, same uid: refused, the first link stays
        got = client(sock, os.getuid(), [reg("j", 0)])
        assert got[0]["type"] == "error" and "already connected" in got[0]["error"]
        assert agent.state.refused[("socket", "duplicate")] == 1
        assert agent.state.jobs["j"].ranks == {0: pid} and agent.state.jobs["j"].connected
        # another rank of the same job from another process is a rank, not a takeover
        assert client(sock, os.getuid(), [reg("j", 1)])[0]["type"] == "registered"
        # the same process reconnecting replaces its own dead-to-us link
        old = agent.link.connections["j"][0]
        again = RawLink(sock)
        assert answer(again.ask(json.dumps(reg("j", 0))))["type"] == "registered"
        wait_for(lambda: old.closed, what="the agent to close the old link")
        assert agent.link.connections["j"][0] is not old
        assert agent.state.jobs["j"].connected and agent.state.jobs["j"].connects == 3
        # a connection re-registers only as itself
        got = answer(again.ask(json.dumps(reg("other", 0))))
        assert got["type"] == "error" and "keeps job_id and rank" in got["error"]
        again.close()
    finally:
        first.close()
        agent.stop()


@pytest.mark.parametrize("value", ["[true]", '["root", -5, 1.5]', "[-5]", "[1.5]", "[4294967295]", '"0"'])
def test_allowed_uids_takes_integers_only(tmp_path: Path, value: str) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(f'[agent]\nnode = "n"\n\n[socket]\nallowed_uids = {value}\n')
    with pytest.raises(ConfigError, match=r"socket\.allowed_uids \(line 5\): "):
        load(path)
    path.write_text("[socket]\nallowed_uids = [0, 65534, 4294967294]\n")
    assert load(path).socket.allowed_uids == [0, 65534, 4294967294]


# --- item 8: `mscale status` prints no terminal escapes a job sent ----------------------------


def test_status_prints_no_terminal_escapes_from_job_strings(sock: str) -> None:
    agent = Agent(sock)
    raw = RawLink(sock)
    try:
        assert answer(raw.ask(json.dumps(reg("esc"))))["type"] == "registered"
        evil = "\x1b]0;owned\x07\x1b[2J\u202eboom\r\n"
        report = {
            "type": "report",
            "job_id": "esc",
            "reports": [
                {"step": 1, "findings": [Finding("loss", Reason.LOSS_SPIKE_WARN, Severity.WARNING, evil).to_dict()]}
            ],
        }
        raw.send(json.dumps(report))
        wait_for(lambda: agent.state.jobs["esc"].step == 1, what="the report")
        mscale = shutil.which("mscale", path=str(Path(sys.executable).parent)) or "mscale"
        out = subprocess.run(
            [mscale, "status", "--agent", f"http://127.0.0.1:{agent.port}"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        assert out.returncode == 0, out.stderr
        assert "boom" in out.stdout and r"\x1b]0;owned\x07\x1b[2J\u202eboom" in out.stdout
        assert not any(c in out.stdout for c in "\x1b\x07\r\u202e")
    finally:
        raw.close()
        agent.stop()


def test_status_renders_any_time_a_job_reported(sock: str) -> None:
    # issue 25: `mscale status --events` gave a traceback for a finding time of 1e308
    agent = Agent(sock)
    raw = RawLink(sock)
    try:
        assert answer(raw.ask(json.dumps(reg("late"))))["type"] == "registered"
        finding = Finding("loss", Reason.LOSS_SPIKE_WARN, Severity.WARNING, "far future", time=1e308).to_dict()
        report = {"type": "report", "job_id": "late", "reports": [{"step": 1, "findings": [finding]}]}
        raw.send(json.dumps(report))
        wait_for(lambda: agent.state.jobs["late"].step == 1, what="the report")
        mscale = shutil.which("mscale", path=str(Path(sys.executable).parent)) or "mscale"
        out = subprocess.run(
            [mscale, "status", "--events", "5", "--agent", f"http://127.0.0.1:{agent.port}"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        line = next(ln for ln in out.stdout.splitlines() if "far future" in ln)
        assert line.split()[0] == "?"
    finally:
        raw.close()
        agent.stop()


def test_one_jobs_finding_flood_is_rate_limited_in_the_log_and_counted() -> None:
    # issue 25: one job's findings flood wrote 72 MiB of log in 31 s; its log lines are now at
    # most 20 per (job, source, reason) every 10 s, the next one saying how many were dropped
    import structlog.testing

    from mscale.daemon.state import JobLogLimit

    now = [0.0]
    events = EventLog(log_limit=JobLogLimit(burst=20, window_s=10.0, clock=lambda: now[0]))
    flood = Finding("hook:loss", Reason.LOSS_SPIKE_WARN, Severity.WARNING, "spike", {"job_id": "noisy"})
    other = Finding("hook:loss", Reason.LOSS_SPIKE_WARN, Severity.WARNING, "spike", {"job_id": "quiet"})
    probe = Finding("gpu", Reason.GPU_XID, Severity.CRITICAL, "xid 79", {"gpu": "0"})
    with structlog.testing.capture_logs() as lines:
        for _ in range(5000):
            events.emit(flood)
        events.emit(other)  # another job's line is not dropped for the noisy one's
        events.emit(probe)  # nor the agent's own findings
        now[0] = 10.0
        events.emit(flood)
    noisy = [ln for ln in lines if ln.get("labels", {}).get("job_id") == "noisy"]
    assert len(noisy) == 21 and noisy[-1]["dropped"] == 4980 and "dropped" not in noisy[0]
    assert [ln["labels"] for ln in lines if ln["labels"].get("job_id") != "noisy"] == [
        {"job_id": "quiet"},
        {"gpu": "0"},
    ]
    assert events.counts[("hook:loss", "loss_spike_warn", "warning")] == 5002  # every finding counted
    assert events.log_limit.dropped_total == 4980
