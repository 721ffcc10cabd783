"""Issue 38, failures 1-6 and 9: what a job's reports may make the agent file for remediation.

A real agent (hook socket, GPU probe over 8 simulated GPUs, healing, standby, remediation with a
real command hook) and, for every attack, a real second local user's job on the socket
(support/report_peer.py): its proofs name GPUs it never ran on, an MPU it never registered, text
for the remediation command, a flood of fake proofs, GPU 4096, quarantines of every GPU. The
agent files only the GPUs the job's own MPUs ran on, with only values it knows; a fatal Xid is
filed whatever the jobs did; the state file's reader takes back all its writer wrote; a FIFO or a
device at the state file's path stops the agent at start-up, untouched."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest
from aiohttp import web

from mscale.daemon.app import create_app, new_state
from mscale.daemon.config import from_dict
from mscale.daemon.link_labels import MAX_PROOFS_PER_MESSAGE
from mscale.findings import Reason
from mscale.kube.remediation import ledger
from mscale.kube.remediation.service import SNAPSHOT
from mscale.kube.remediation.verdicts import MAX_FAULTS, Fault
from mscale.sim.nvml import SimNvml
from mscale.sim.timeline import event_from_dict
from support import free_port, require
from support.link_agent import RawLink, wait_for
from support.users import second_uid

PEER = Path(__file__).parent / "support" / "report_peer.py"
NODE = "gpu-node-7"
GPUS = 8
FEATURES = (
    "mscale.daemon.api",
    "mscale.daemon.link",
    "mscale.daemon.standby",
    "mscale.daemon.healing",
    "mscale.daemon.remediation",
)


# --- a real agent over simulated GPUs ------------------------------------------------------


class NodeAgent:
    """The agent's app (its features above, the GPU probe over `sim` run by its probe runner)
    served from its own thread and event loop; `stop` and a new one on the same state file is a
    restart."""

    def __init__(self, sock: str, sim: SimNvml, hook: str, state_file: str, other: int, **remediation) -> None:
        self.sim = sim
        cfg = {
            "agent": {"listen": f"127.0.0.1:{free_port()}", "socket_path": sock, "node": NODE},
            "socket": {"mode": 0o666, "allowed_uids": [other]},
            "probes": {"gpu": {"interval_s": 0.1}, "host": {"enabled": False}, "ebpf": {"enabled": False}},
            "remediation": {
                "interval_s": 0.5,
                "state_file": state_file,
                "command": {"enabled": True, "argv": [hook]},
                **remediation,
            },
        }
        self.config = from_dict(cfg)
        self.loop = asyncio.new_event_loop()
        self.failed: BaseException | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(30), "agent did not start"
        if self.failed is not None:
            raise self.failed

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            try:
                self.app = create_app(self.config, state=new_state(self.config), nvml=self.sim, features=FEATURES)
                self.runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
                await self.runner.setup()
            except BaseException as e:
                self.failed = e
                self.started.set()
                return
            self.stopping = asyncio.Event()
            self.started.set()
            await self.stopping.wait()
            await self.runner.cleanup()

        self.loop.run_until_complete(main())

    @property
    def state(self):
        from mscale.daemon import keys

        return self.app[keys.STATE]

    def remediation(self):
        return self.state.snapshots[SNAPSHOT]

    def faults(self) -> dict[tuple[str, int], Fault]:
        return {(f.kind, f.gpu): f for f in self.remediation().faults}

    def stop(self) -> None:
        if self.failed is None:
            self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(30)


@pytest.fixture
def other() -> tuple[int, int]:
    return second_uid()


@pytest.fixture
def node(tmp_path: Path, other):
    """(socket path, simulated GPUs, command hook, state file): the socket in a root-owned 0755
    directory the second user can reach."""
    run = Path(tempfile.mkdtemp(prefix="mscale-rem-"))
    os.chmod(run, 0o755)
    calls = tmp_path / "calls.jsonl"
    script = tmp_path / "gpu-remediate"
    script.write_text(
        textwrap.dedent(
            f"""\
            #!{sys.executable}
            import json, os, sys
            with open({str(calls)!r}, "a") as f:
                f.write(json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ)}}) + "\\n")
            """
        )
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)

    class Node:
        sock = str(run / "agent.sock")
        sim = SimNvml(GPUS, model="h100")
        hook = str(script)
        state_file = str(tmp_path / "state" / "remediation.json")
        uid = other[0]

        @staticmethod
        def calls() -> list[dict]:
            return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []

        def agent(self, **remediation) -> NodeAgent:
            return NodeAgent(self.sock, self.sim, self.hook, self.state_file, self.uid, **remediation)

        def xid(self, gpu: int, code: int = 79) -> None:
            self.sim.inject(event_from_dict({"gpu": gpu, "fault": "xid", "code": code}, gpus=GPUS))

    (tmp_path / "state").mkdir()
    yield Node()
    shutil.rmtree(run, ignore_errors=True)


def filed(node, kind: str | None = None) -> list[tuple[str, str, str]]:
    """(kind, GPU index, GPU UUID) of every `file` the command was run for."""
    return [(c["argv"][4], c["argv"][3], c["argv"][2]) for c in node.calls() if c["argv"][0] == "file"]


def wait_filed(node, agent, kind: str, gpu: int) -> None:
    """Until the command was run to file GPU `gpu`'s `kind` fault and the agent shows it filed
    (20 s at most)."""
    want = (kind, str(gpu), node.sim.uuids[gpu])
    wait_for(lambda: want in filed(node), 20, f"the command to file {kind} on GPU {gpu}")
    wait_for(
        lambda: any((f.kind, f.gpu) == (kind, gpu) for f in agent.remediation().filed["command"]),
        20,
        f"{kind} on GPU {gpu} shown filed",
    )


# --- a job's frames ----------------------------------------------------------------------------


def register(job: str, mpus: dict[str, int], rank: int = 0) -> dict:
    return {
        "type": "register",
        "job_id": job,
        "rank": rank,
        "pid": 1,
        "step": 0,
        "mpus": [{"mpu_id": m, "name": f"mpu{m}", "gpu": g, "params": 10} for m, g in mpus.items()],
    }


def report(job: str, findings: list[dict], step: int = 1) -> dict:
    return {"type": "report", "job_id": job, "dropped": 0, "reports": [{"step": step, "findings": findings}]}


def finding(reason: str, labels: dict, severity: str = "warning") -> dict:
    return {"source": "fuse", "reason": reason, "severity": severity, "message": reason, "labels": labels}


def proof(mpu: str, gpu: str, *, to: str = "6", **extra: str) -> list[dict]:
    """What a job's fuse reports of an SDC proof: an L1 swap off `gpu` for a checksum failure,
    then the MPU clean on the standby."""
    swap = {"action": "l1_swap", "result": "applied", "reason": "checksum_failure", "level": "L1"}
    clean = {"before": "l1_swapped", "state": "recovered"}
    return [
        finding("heal_action", {**swap, "mpu_id": mpu, "gpu": gpu, "to_gpu": to, **extra}, "critical"),
        finding("fuse_state", {**clean, "mpu_id": mpu}, "info"),
    ]


def attack(node, frames: list[dict]) -> list[dict]:
    """Send `frames` as the second user; the answers (the last: the barrier's)."""
    proc = subprocess.run(
        [sys.executable, str(PEER), str(node.uid), node.sock],
        input=json.dumps(frames),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    answers = [json.loads(line) for line in proc.stdout.splitlines()]
    assert answers and answers[-1]["type"] == "registered", answers
    return answers


# --- 1. only the GPUs its MPUs ran on -------------------------------------------------------


def test_a_job_gets_only_the_gpus_its_own_mpus_ran_on_filed(node) -> None:
    agent = node.agent()
    try:
        # the issue's attack: the job's only MPU runs on GPU 0; its proofs name GPU 5, and an
        # MPU it never registered names GPU 6
        attack(node, [register("evil", {"001": 0}), report("evil", proof("001", "5") + proof("077", "6", to="7"))])
        node.xid(3)  # a barrier: the hand-off took every event before the probe's fatal Xid
        wait_filed(node, agent, "xid", 3)
        # only the GPU its MPU did run on (before: GPUs 5 and 6)
        assert sorted((k, g) for k, g, _ in filed(node)) == [("sdc", "0"), ("xid", "3")]
        assert set(agent.faults()) == {("sdc", 0), ("xid", 3)}
        verdicts = [f for _, f in agent.state.events.since(0) if f.reason is Reason.GPU_FAULT_VERDICT]
        assert sorted(f.labels["gpu"] for f in verdicts) == ["0", "3"]
        assert agent.state.refused[("socket", "unregistered_mpu")] == 2  # both of MPU 077's findings
        # GPU 5 stays a standby: asked for one by the victim, it is granted
        victim = RawLink(node.sock)
        try:
            assert json.loads(victim.ask(json.dumps(register("victim", {"001": 1}))))["type"] == "registered"
            ask = {"type": "standby_request", "id": 1, "mpu_id": "001", "gpu": 1, "avoid": [2, 3, 4]}
            assert json.loads(victim.ask(json.dumps(ask)))["gpu"] == 5
        finally:
            victim.close()
    finally:
        agent.stop()


# --- 2. only values the agent knows reach the command ----------------------------------------


def test_no_job_text_reaches_the_remediation_command(node) -> None:
    agent = node.agent()
    evil = "--force\nMSCALE_NODE=other-node\x1b]0;pwn\x07"
    try:
        frames = [register("evil", {"001": 0}), report("evil", proof("001", "99", to="\x1b]0;pwn", gpu_uuid=evil))]
        attack(node, frames)
        node.xid(3)
        wait_filed(node, agent, "xid", 3)
        calls = node.calls()
        assert calls, "nothing was filed"
        known = {NODE, *node.sim.uuids, *(str(i) for i in range(GPUS))}
        for call in calls:
            argv, env = call["argv"], call["env"]
            event, at, uuid, index = argv[:4]
            assert (at, env["MSCALE_NODE"]) == (NODE, NODE)
            assert uuid in node.sim.uuids and env["MSCALE_GPU_UUID"] == uuid, call
            assert index in known and env["MSCALE_GPU_INDEX"] == index
            assert env.get("MSCALE_STANDBY_GPU", "0") in known, call
            for k, v in [*env.items(), *((str(i), a) for i, a in enumerate(argv))]:
                assert v.isprintable() and "other-node" not in v and not v.startswith("--"), (k, v)
        assert ("sdc", "0", node.sim.uuids[0]) in filed(node)  # the GPU its MPU ran on, by the agent's UUID
    finally:
        agent.stop()


# --- 3. budgets per source: a fatal Xid never waits behind a job's proofs --------------------


def test_a_fatal_xid_is_filed_whatever_the_jobs_proofs_spent(node) -> None:
    agent = node.agent(max_filings_per_hour=1)
    try:
        attack(node, [register("evil", {"001": 0, "002": 1}), report("evil", proof("001", "0") + proof("002", "1"))])
        wait_for(lambda: len(agent.faults()) == 2, 20, "both proofs on the books")
        assert len(filed(node)) == 1  # the jobs' budget: one an hour
        node.xid(3)
        wait_filed(node, agent, "xid", 3)  # before: deferred until the hour rolled over
        deferred = [f for _, f in agent.state.events.since(0) if f.labels.get("result") == "deferred"]
        assert [f.labels["kind"] for f in deferred] == ["sdc"]  # the second proof, not the Xid
    finally:
        agent.stop()


# --- 4. a flood of proofs in one message ------------------------------------------------------


def test_one_message_of_fake_proofs_leaves_room_for_the_probes_fault(node) -> None:
    agent = node.agent()
    try:
        # 1,152 proofs (2,304 findings) in one message of 9 step reports: each names another GPU
        # that is not on the node, with a UUID of its own
        flood = [f for i in range(1152) for f in proof("001", str(100 + i), gpu_uuid=f"GPU-fake-{i}")]
        steps = [{"step": s + 1, "findings": flood[s * 256 : (s + 1) * 256]} for s in range(9)]
        frames = [register("evil", {"001": 0}), {"type": "report", "job_id": "evil", "dropped": 0, "reports": steps}]
        attack(node, frames)
        node.xid(4)
        wait_filed(node, agent, "xid", 4)  # before: the book was full, the Xid never opened
        assert agent.state.refused[("socket", "proof_limit")] == len(flood) - MAX_PROOFS_PER_MESSAGE
        assert set(agent.faults()) <= {("sdc", 0), ("xid", 4)}
        assert len(agent.faults()) < MAX_FAULTS
    finally:
        agent.stop()


# --- 5. the state file's writer writes only what its reader takes -----------------------------


def test_a_job_made_verdict_cannot_make_a_restart_forget_every_verdict(node) -> None:
    agent = node.agent()
    try:
        for gpu in range(1, GPUS):  # seven fatal Xids and the victim's proven SDC on GPU 0
            node.xid(gpu)
        victim = RawLink(node.sock)
        try:
            assert json.loads(victim.ask(json.dumps(register("victim", {"001": 0}))))["type"] == "registered"
            victim.send(json.dumps(report("victim", proof("001", "0", to="1"))))
            wait_for(lambda: len(agent.faults()) == GPUS, 20, "8 open faults")
        finally:
            victim.close()
        # the issue's attack: one proof on GPU "4096", which the reader refuses
        attack(node, [register("evil", {"001": 0}), report("evil", proof("001", "4096", gpu_uuid="GPU-4096"))])
        node.xid(0)  # a barrier: the hand-off took the attack's events before this one
        wait_for(lambda: ("xid", 0) in agent.faults(), 20, "the Xid on GPU 0")
        before = set(agent.faults())
        wait_for(lambda: len(on_disk(node)) == len(before), 20, "the state file to hold every fault")
    finally:
        agent.stop()
    assert before >= {("sdc", 0), *(("xid", g) for g in range(GPUS))}  # 9 open faults
    restarted = node.agent()
    try:
        assert set(restarted.faults()) == before  # before: 0, the whole file set aside
        assert not Path(node.state_file + ".bad").exists()
    finally:
        restarted.stop()


def on_disk(node) -> list[dict]:
    """The faults in the state file as written (read as JSON, not through the reader)."""
    try:
        return json.loads(Path(node.state_file).read_text())["faults"]
    except (FileNotFoundError, ValueError):
        return []


def _fault(gpu: int, uuid: str, kind: str = "xid") -> Fault:
    return Fault(kind, gpu, uuid, "GPUXid79", "RESTART_BM", f"GPU {gpu} failed", 1.0e9, "boot", 0, {"xid": "79"})


def test_the_reader_drops_a_bad_record_and_keeps_the_others(tmp_path: Path) -> None:
    path = tmp_path / "remediation.json"
    good = [_fault(1, "GPU-1"), _fault(2, "GPU-2")]
    ledger.save(str(path), tuple(good), {"command": (good[0],)})
    doc = json.loads(path.read_text())
    doc["faults"].insert(1, {**doc["faults"][0], "gpu": 4096})  # what a job once made the writer write
    doc["faults"].append({**doc["faults"][0], "gpu_uuid": "--force"})
    doc["filed"]["command"].append({**doc["faults"][0], "facts": {"standby_gpu": "\x1b]0;pwn"}})
    path.write_text(json.dumps(doc))
    faults, filings, dropped = ledger.load(str(path))
    assert faults == good and filings == {"command": [good[0]]}
    assert sorted(d.split(":")[0] for d in dropped) == ["faults[1]", "faults[3]", "filed.command[1]"]
    # and the writer leaves out what the reader would drop
    ledger.save(str(path), (good[0], _fault(4096, "GPU-4096"), _fault(3, "--force")), {})
    assert ledger.load(str(path)) == ([good[0]], {}, [])


# --- 6. a job's quarantine reports take no standby away -------------------------------------


def test_a_jobs_quarantine_reports_take_no_standby_from_another_users_job(node) -> None:
    agent = node.agent()
    try:
        quarantines = [
            finding("heal_action", {"action": "quarantine_gpu", "result": "applied", "gpu": str(g), "mpu_id": "001"})
            for g in range(GPUS)
        ]
        forged = [finding("gpu_xid", {"gpu": str(g), "action": "RESET_GPU"}, "critical") for g in range(GPUS)]
        attack(node, [register("evil", {"001": 0}), report("evil", quarantines + forged)])
        assert agent.state.refused[("socket", "bad_finding")] == GPUS  # a gpu_xid is the probe's to say
        victim = RawLink(node.sock)
        try:
            assert json.loads(victim.ask(json.dumps(register("victim", {"001": 1}))))["type"] == "registered"
            ask = {"type": "standby_request", "id": 1, "mpu_id": "001", "gpu": 1, "avoid": []}
            answer = json.loads(victim.ask(json.dumps(ask)))
        finally:
            victim.close()
        # GPU 0 is the attacker's (in use by another rank), GPU 1 the one it leaves: 2, not none
        assert answer["gpu"] == 2, answer
    finally:
        agent.stop()


# --- 9. a FIFO or a device at the state file's path --------------------------------------------


def _agent_with_state_file(tmp_path: Path, state_file: Path) -> subprocess.CompletedProcess:
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[remediation]\nstate_file = "{state_file}"\n')
    argv = ["--config", str(cfg), "--listen", "127.0.0.1:0", "--socket", str(tmp_path / "a.sock")]
    return subprocess.run([sys.executable, "-m", "mscale", "agent", *argv], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("kind", ["fifo", "char_device"])
def test_a_state_file_that_is_not_a_regular_file_stops_the_agent_untouched(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "remediation.json"
    if kind == "fifo":
        os.mkfifo(path)
        what = "a FIFO"
    else:
        require(os.getuid() == 0, "making a device node needs root")  # CI is root: it runs there
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers
        what = "a character device"
    proc = _agent_with_state_file(tmp_path, path)  # before: a FIFO hung the start (timeout here)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert f"remediation.state_file: {path}: {what}, not a regular file" in proc.stderr, proc.stderr
    st = os.lstat(path)  # before: the root agent renamed the device to .bad
    assert (stat.S_ISFIFO(st.st_mode) if kind == "fifo" else stat.S_ISCHR(st.st_mode)) and not Path(
        f"{path}.bad"
    ).exists()


def test_the_service_refuses_a_fifo_without_waiting_for_a_writer(tmp_path: Path) -> None:
    from mscale.daemon.state import AgentState
    from mscale.kube.remediation.service import RemediationService

    path = tmp_path / "remediation.json"
    os.mkfifo(path)
    cfg = from_dict({"remediation": {"state_file": str(path)}})

    def writer() -> None:  # a bound on the old code's hang: a writer, then EOF, 30 s on
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)

    unblock = threading.Timer(30, writer)
    unblock.start()
    try:
        # (StateFileRefused, a ValueError; before: blocked in open(), then set the FIFO aside)
        with pytest.raises(ValueError, match="a FIFO, not a regular file"):
            RemediationService(AgentState(node=NODE), cfg.remediation, [])
    finally:
        unblock.cancel()
    with pytest.raises(ValueError, match="a FIFO, not a regular file"):
        ledger.save(str(path), (_fault(1, "GPU-1"),), {})  # never replaced either
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
