"""The link's intake (mscale.daemon.link_intake): frames handled one per loop turn, each
connection's in order, superseded report frames shed when behind, findings never."""

from __future__ import annotations

import asyncio
import json
import urllib.request

from mscale.daemon import link_intake
from mscale.daemon.link_intake import MAX_QUEUED, Inbox, Intake, sheddable
from support.link_agent import Agent, RawLink, metric, wait_for


def _report(step: int, findings: bool = False) -> str:
    finding = {"source": "hook:loss", "reason": "loss_spike", "severity": "warning", "message": "x"}
    return json.dumps(
        {"type": "report", "job_id": "j", "reports": [{"step": step, "findings": [finding] if findings else []}]}
    )


def test_a_frame_is_sheddable_only_when_it_is_a_report_without_findings() -> None:
    assert sheddable(_report(1))
    assert not sheddable(_report(1, findings=True))
    assert not sheddable(json.dumps({"type": "register", "job_id": "j", "rank": 0}))


async def _run_behind(frames: dict[str, list[str]]) -> tuple[list[tuple[str, str]], int, list[str]]:
    """Queue every connection's frames before the intake runs (the agent behind), then let it
    handle them all; what it handled, in order, and what ran between."""
    handled: list[tuple[str, str]] = []
    order: list[str] = []
    shed: list[int] = []

    async def handle(conn: str, data: str) -> None:
        handled.append((conn, data))
        order.append("frame")

    intake = Intake(handle, on_shed=lambda: shed.append(1))
    inboxes = {c: Inbox(c) for c in frames}
    for c, texts in frames.items():
        for t in texts:
            assert await intake.put(inboxes[c], t)
    stop = asyncio.Event()

    async def ticker() -> None:  # what a probe's handler is to the loop: it wants a turn
        while not stop.is_set():
            order.append("tick")
            await asyncio.sleep(0)

    tick = asyncio.ensure_future(ticker())
    intake.start()
    async with asyncio.timeout(10):
        for box in inboxes.values():
            await intake.drained(box)
    stop.set()
    await tick
    await intake.stop()
    assert intake.shed == len(shed)
    return handled, intake.shed, order


def test_behind_the_oldest_superseded_reports_are_shed_and_the_rest_kept_in_order() -> None:
    frames = [_report(s, findings=s in (0, 3)) for s in range(MAX_QUEUED + 4)]
    handled, shed, _ = asyncio.run(_run_behind({"a": frames}))
    steps = [json.loads(d)["reports"][0]["step"] for _, d in handled]
    # 4 past the bound: the 4 oldest reports without findings go (1, 2, 4, 5); 0 and 3 stay
    assert shed == 4
    assert steps == [0, 3, *range(6, MAX_QUEUED + 4)]


def test_a_connection_whose_waiting_frames_all_carry_findings_waits_for_room_none_is_shed() -> None:
    async def main() -> tuple[list[int], int]:
        done: list[int] = []

        async def handle(conn: str, data: str) -> None:
            done.append(json.loads(data)["reports"][0]["step"])

        intake = Intake(handle)
        box = Inbox("a")
        for s in range(MAX_QUEUED):
            await intake.put(box, _report(s, findings=True))
        late = asyncio.ensure_future(intake.put(box, _report(MAX_QUEUED, findings=True)))
        await asyncio.sleep(0)
        assert not late.done()  # no room, nothing it may drop: it waits
        intake.start()
        async with asyncio.timeout(10):
            assert await late
            await intake.drained(box)
        await intake.stop()
        return done, intake.shed

    done, shed = asyncio.run(main())
    assert done == list(range(MAX_QUEUED + 1)) and shed == 0


def test_connections_take_turns_and_the_loop_gets_a_turn_between_any_two_frames() -> None:
    frames = {c: [_report(s) for s in range(5)] for c in "abc"}
    handled, shed, order = asyncio.run(_run_behind(frames))
    assert shed == 0
    assert [c for c, _ in handled] == list("abc" * 5)
    for c in "abc":  # each connection's frames in the order they came
        assert [json.loads(d)["reports"][0]["step"] for x, d in handled if x == c] == list(range(5))
    # between any two frames handled, the other task ran: report work never holds the loop longer
    assert all(not (x == y == "frame") for x, y in zip(order, order[1:], strict=False))


def test_a_reader_refused_room_for_too_long_is_counted(monkeypatch) -> None:
    monkeypatch.setattr(link_intake, "ROOM_WAIT_S", 0.01)

    async def main() -> tuple[bool, int]:
        async def handle(conn: str, data: str) -> None:
            return None

        intake = Intake(handle)  # never started: the agent takes nothing
        box = Inbox("a")
        for s in range(MAX_QUEUED):
            await intake.put(box, _report(s, findings=True))
        return await intake.put(box, _report(99, findings=True)), intake.refused

    assert asyncio.run(main()) == (False, 1)


# --- through a real agent's socket: the test holds the intake with its own plugin message ------


def test_a_real_agent_behind_sheds_a_connections_oldest_reports_and_applies_the_rest_in_order(tmp_path) -> None:
    agent = Agent(str(tmp_path / "run" / "agent.sock"))
    gate = asyncio.Event()

    async def hold(job, msg) -> None:  # the test's own handler: the intake waits here
        await gate.wait()

    agent.link.on_message("hold", hold)
    link = RawLink(agent.socket_path)
    try:
        mpus = [{"mpu_id": "001", "name": "m0", "gpu": 0, "params": 10}]
        reg = {"type": "register", "job_id": "job-1", "rank": 0, "pid": 1, "step": 0, "mpus": mpus}
        assert json.loads(link.ask(json.dumps(reg)))["type"] == "registered"
        link.send(json.dumps({"type": "hold"}))
        for s in range(MAX_QUEUED + 4):
            steps = [{"step": s, "mpus": {"001": {"forward_s": 0.01, "backward_s": 0.02}}}]
            link.send(json.dumps({"type": "report", "job_id": "job-1", "dropped": 0, "reports": steps}))
        # the agent is behind (its intake held): past 8 waiting frames the oldest reports go
        wait_for(lambda: agent.state.reports_shed == 4, what="4 reports shed")
        assert urllib.request.urlopen(f"http://127.0.0.1:{agent.port}/healthz", timeout=10).status == 200
        agent.loop.call_soon_threadsafe(gate.set)
        rs = agent.state.jobs["job-1"].rank_states[0]
        wait_for(lambda: rs.step == MAX_QUEUED + 3, what="the last report")
        assert rs.reports_total == MAX_QUEUED  # steps 4..11, in order (the last one applied is the newest)
        assert metric(agent.metrics(), "mscale_link_reports_shed_total") == 4
    finally:
        link.close()
        agent.stop()
