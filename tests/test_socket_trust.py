"""Issue 25 items 1 and 2: the hook socket is created with its mode and no path followed, in a
directory no other user can change; and the job speaks only to a listener whose uid it trusts
(SO_PEERCRED on the client side). The attackers are real processes of a real second user."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from mscale import link as protocol
from mscale.daemon import socket_file
from mscale.findings import Reason
from mscale.hook.core.attach import attach
from support import stop_process
from support.link_agent import Agent, wait_for
from support.users import second_uid

SUPPORT = Path(__file__).parent / "support"


@pytest.fixture
def other() -> tuple[int, int]:
    return second_uid()


@pytest.fixture
def attacker_dir(other):
    """A socket directory the second user owns (e.g. a `socket_path` under a shared one)."""
    tmp = tempfile.mkdtemp(prefix="mscale-trust-")
    os.chmod(tmp, 0o755)
    os.chown(tmp, *other)
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


def as_user(other: tuple[int, int], script: str, *args: str) -> subprocess.Popen:
    # the script drops to the other uid itself, after its imports (the interpreter is root's)
    return subprocess.Popen(
        [sys.executable, str(SUPPORT / script), str(other[0]), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def first_line(proc: subprocess.Popen) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the attacker's process did not start: {proc.stderr.read() if proc.stderr else ''}"
    return line


# --- item 1: no chmod of a path another user can swap -----------------------------------------


def test_root_agent_cannot_be_made_to_chmod_a_file_through_the_socket_race(tmp_path: Path, other, attacker_dir) -> None:
    # the attack: swap the socket for a symlink to a root-owned 0600 file between the
    # agent's bind and its chmod; the attacker races five agent start-ups (bounded: 10 s, 50 swaps)
    target = tmp_path / "root-secret"
    target.write_text("root only\n")
    os.chmod(target, 0o600)
    sock = os.path.join(attacker_dir, "agent.sock")
    swapper = as_user(other, "socket_swapper.py", sock, str(target), "10", "50")
    try:
        assert first_line(swapper).strip() == "ready"
        for _ in range(5):
            agent = Agent(sock, mode=0o666)
            try:
                assert "owned by uid" in agent.link.error and attacker_dir in agent.link.error, agent.link.error
            finally:
                agent.stop()
    finally:
        stop_process(swapper)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600
    assert not os.path.exists(sock)


@pytest.mark.parametrize(
    "mode,owner,words",
    [
        (0o777, "root", "writable by others"),
        (0o1777, "root", "writable by others"),  # sticky: others can still squat the name first
        (0o775, "root", "writable by its group"),
        (0o755, "other", "owned by uid"),
    ],
)
def test_a_socket_directory_another_user_can_change_is_refused(other, mode: int, owner: str, words: str) -> None:
    tmp = tempfile.mkdtemp(prefix="mscale-trust-")
    try:
        os.chmod(tmp, mode)
        if owner == "other":
            os.chown(tmp, *other)
        agent = Agent(os.path.join(tmp, "agent.sock"))
        try:
            assert words in agent.link.error and tmp in agent.link.error, agent.link.error
            assert not os.path.exists(os.path.join(tmp, "agent.sock"))
        finally:
            agent.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_an_ancestor_another_user_owns_is_refused(tmp_path: Path, other) -> None:
    # the attacker could rename the directory its own directory holds
    outer = tmp_path / "theirs"
    (outer / "run").mkdir(parents=True)
    os.chown(outer, *other)
    with pytest.raises(socket_file.UnsafeSocketDir, match="an ancestor of the socket directory .*theirs"):
        socket_file.check_directory(outer / "run")


def test_the_socket_has_its_mode_when_created_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        for mode in (0o600, 0o660, 0o666):
            path = str(tmp_path / f"s{mode:o}.sock")
            sock = socket_file.bind(path, mode)
            try:
                st = os.lstat(path)
                assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == mode
            finally:
                sock.close()
    finally:
        os.umask(old)
    # a symlink in its place is never followed: bind refuses it, its target keeps its mode
    target = tmp_path / "file"
    target.write_text("x")
    os.chmod(target, 0o600)
    os.symlink(target, tmp_path / "link.sock")
    with pytest.raises(OSError):
        socket_file.bind(str(tmp_path / "link.sock"), 0o666)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o600


# --- item 2: the job checks who listens -------------------------------------------------------


def tiny_job(sock: str, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mpus = {"vision": model[0], "text": model[1]}
    guard = attach(model, opt, job_id="team-a/run-1", socket_path=sock, cmsa=False, mpus=mpus, **kw)

    def train(n: int) -> None:
        for _ in range(n):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()

    return guard, model, train


def fake_agent(other, attacker_dir: str) -> tuple[subprocess.Popen, str]:
    sock = os.path.join(attacker_dir, "agent.sock")
    fake = as_user(other, "fake_agent.py", sock, "60")
    assert json.loads(first_line(fake)) == {"ready": other[0]}
    return fake, sock


def frames_seen(fake: subprocess.Popen) -> list[dict]:
    stop_process(fake)
    assert fake.stdout is not None
    return [json.loads(line) for line in fake.stdout.read().splitlines() if line.strip()]


def test_a_job_tells_a_fake_agent_nothing_and_takes_no_command_from_it(other, attacker_dir, monkeypatch) -> None:
    # the attack: the socket directory's owner serves its own socket; the job registered
    # with it, sent every report and took its rollback
    monkeypatch.delenv(protocol.AGENT_UID_ENV, raising=False)
    fake, sock = fake_agent(other, attacker_dir)
    guard, model, train = tiny_job(sock)
    try:
        before = [p.detach().clone() for p in model.parameters()]
        wait_for(lambda: guard.link.untrusted_uid == other[0], what="the job to see who listens")
        train(5)  # the job runs alone: training goes on
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        found = [f for f in guard.findings if f.reason is Reason.AGENT_UNTRUSTED]
        assert len(found) == 1 and found[0].labels["peer_uid"] == str(other[0])
        assert f"uid {other[0]}" in found[0].message and found[0].labels["job_id"] == "team-a/run-1"
        assert guard.link.commands_received == 0 and not guard.link.connected
        assert guard.poll_commands() == 0
    finally:
        guard.detach()
        seen = frames_seen(fake)
    assert not [s for s in seen if "frame" in s], f"the job told the fake agent: {seen}"


def test_the_configured_agent_uid_is_trusted(other, attacker_dir, monkeypatch) -> None:
    # an agent run as its own user: MSCALE_AGENT_UID names it, and the job speaks to it
    monkeypatch.setenv(protocol.AGENT_UID_ENV, str(other[0]))
    fake, sock = fake_agent(other, attacker_dir)
    guard, _model, train = tiny_job(sock)
    try:
        wait_for(lambda: guard.link.connected, what="the job to connect")
        train(2)
        wait_for(lambda: guard.link.sent >= 2, what="the reports")
        assert not [f for f in guard.findings if f.reason is Reason.AGENT_UNTRUSTED]
    finally:
        guard.detach()
        seen = frames_seen(fake)
    assert any(s.get("frame", {}).get("type") == "register" for s in seen), seen


@pytest.mark.parametrize("value", ["-1", "root", "4294967295", "1e3", "9" * 40])
def test_a_bad_agent_uid_is_refused_naming_it(monkeypatch, value: str) -> None:
    monkeypatch.setenv(protocol.AGENT_UID_ENV, value)
    with pytest.raises(ValueError, match=f"{protocol.AGENT_UID_ENV}: expected a uid"):
        protocol.agent_uids()
    assert protocol.agent_uids(1000) == {0, os.geteuid(), 1000}


def test_the_real_root_agent_is_trusted(tmp_path: Path) -> None:
    sock = str(tmp_path / "run" / "agent.sock")
    agent = Agent(sock)
    guard, _model, train = tiny_job(sock)
    try:
        wait_for(lambda: "team-a/run-1" in agent.state.jobs, what="the registration")
        train(2)
        wait_for(lambda: agent.state.jobs["team-a/run-1"].step == 1, what="the reports")
        assert guard.link.untrusted_uid is None
    finally:
        guard.detach()
        agent.stop()
