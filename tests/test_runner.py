"""Probe isolation: a probe that raises and one that hangs are marked down and counted, logged
once per change, and the others keep exporting; a hung probe comes back when it answers."""

from __future__ import annotations

import asyncio
import io
import threading
import time

import aiohttp
import pytest
import structlog
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from mscale import logs
from mscale.daemon import keys
from mscale.daemon.app import create_app
from mscale.daemon.config import from_dict
from mscale.daemon.state import AgentState
from mscale.findings import Reason
from mscale.probes import nvml_api
from mscale.probes.base import ProbeUnavailable
from mscale.probes.gpu import GpuProbe, NvmlReader
from mscale.probes.gpu_health import HealthModel
from mscale.sim.nvml import SimNvml


@pytest.fixture(autouse=True)
def agent_logging():
    """Log as the agent does (info, JSON): structlog's unconfigured default renders every
    debug traceback richly, which a probe failing every 50 ms turns into the bottleneck."""
    logs.configure("info", json=True, stream=io.StringIO())
    yield
    structlog.reset_defaults()


class Boom:
    name = "boom"

    def sample(self):
        raise RuntimeError("sensor exploded")

    def close(self) -> None:
        pass


class Hang:
    name = "hang"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def sample(self):
        self.calls += 1
        self.release.wait(30)
        return ("hang-snapshot", self.calls)

    def close(self) -> None:
        self.release.set()


class Absent:
    name = "absent"

    def sample(self):
        raise ProbeUnavailable("no such hardware here")

    def close(self) -> None:
        pass


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


async def scrape(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(url + "/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


# every request has its own deadline (aiohttp's default is 300 s, the whole test's budget)
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=10)


async def until(fn, timeout_s: float = 20.0):
    """Poll `fn` until it returns something true; a request that timed out or dropped is a
    try that did not answer, retried while the deadline holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = await fn()
        except (TimeoutError, aiohttp.ClientError):
            result = None
        if result:
            return result
        assert time.monotonic() < deadline, "condition not met before the deadline"
        await asyncio.sleep(0.05)


async def test_raising_and_hanging_probes_are_isolated() -> None:
    cfg = from_dict({})
    state = AgentState(node="n")
    sim = SimNvml(4)
    gpu = GpuProbe(NvmlReader(sim, backend="sim"), HealthModel(cfg.health), emit=state.events.emit)
    hang = Hang()
    probes = [(gpu, 0.05, 1.0), (Boom(), 0.05, 1.0), (hang, 0.05, 0.2), (Absent(), 0.05, 1.0)]
    app = create_app(cfg, state=state, probes=probes, features=("mscale.daemon.api",))
    runner, url = await serve(app)
    try:
        async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:

            async def broken_and_counted():
                m = await scrape(session, url)
                up = {p: m.get(("mscale_probe_up", (("probe", p),))) for p in ("gpu", "boom", "hang", "absent")}
                errors = {p: m.get(("mscale_probe_errors_total", (("probe", p),))) for p in ("boom", "hang", "absent")}
                ok = up == {"gpu": 1, "boom": 0, "hang": 0, "absent": 0} and errors["boom"] >= 3 and errors["hang"] >= 3
                return m if ok else None

            m = await until(broken_and_counted)
            assert m[("mscale_probe_errors_total", (("probe", "absent"),))] == 0  # not there is not a failure
            # The GPU probe keeps sampling and exporting while the others fail.
            before = state.probe_status["gpu"].samples_total
            await until(lambda: _ready(state.probe_status["gpu"].samples_total >= before + 3))
            m = await scrape(session, url)
            assert m[("mscale_gpu_health", (("gpu", "0"), ("gpu_uuid", sim.uuids[0]), ("state", "healthy")))] == 1
            assert hang.calls == 1  # quarantined: never sampled again while the first call hangs
            st = state.probe_status
            assert "sensor exploded" in st["boom"].reason and "hung" in st["hang"].reason
            assert "no such hardware here" in st["absent"].reason
            # Logged once per change, not once per failure.
            downs = [f.labels["probe"] for _, f in state.events.since(0) if f.reason is Reason.PROBE_DOWN]
            assert sorted(downs) == ["absent", "boom", "hang"]

            async with session.get(url + "/api/v1/probes") as r:
                body = await r.json()
            assert body["boom"]["up"] is False and body["gpu"]["up"] is True

            hang.release.set()  # the hung call returns: the probe is up again
            await until(lambda: _ready(state.probe_status["hang"].up is True))
            ups = [f.labels["probe"] for _, f in state.events.since(0) if f.reason is Reason.PROBE_UP]
            assert ups.count("hang") == 1
            assert state.snapshots["hang"][0] == "hang-snapshot"
    finally:
        hang.release.set()
        await runner.cleanup()


async def _ready(value: bool) -> bool:
    return value


async def test_gpu_probe_without_nvml_reports_why() -> None:
    try:
        nvml_api.open_real_nvml().close()
        has_driver = True
    except nvml_api.NvmlUnavailable:
        has_driver = False
    cfg = from_dict({"probes": {"host": {"enabled": False}, "ebpf": {"enabled": False}}})
    app = create_app(cfg, nvml=None, features=("mscale.daemon.api",))
    runner, url = await serve(app)
    try:
        state = app[keys.STATE]
        await until(lambda: _ready(state.probe_status["gpu"].up is not None))
        st = state.probe_status["gpu"]
        if has_driver:
            assert st.up is True
        else:
            assert st.up is False and "NVML not available" in st.reason
            async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
                async with session.get(url + "/healthz") as r:
                    assert r.status == 200 and (await r.json())["probes"]["gpu"] is False
    finally:
        await runner.cleanup()


async def test_disabled_probe_exports_no_up_series() -> None:
    """A probe switched off in config is 'no data', not 'down': no alert may fire on it."""
    cfg = from_dict({"probes": {"host": {"enabled": False}, "ebpf": {"enabled": False}, "gpu": {"enabled": False}}})
    app = create_app(cfg, features=("mscale.daemon.api",))
    runner, url = await serve(app)
    try:
        async with aiohttp.ClientSession(timeout=REQUEST_TIMEOUT) as session:
            m = await scrape(session, url)
        assert not [k for k in m if k[0] == "mscale_probe_up"]
        assert app[keys.STATE].probe_status["host"].enabled is False
    finally:
        await runner.cleanup()


class Instant:
    """Answers at once: its sample lands in the same loop turn as a stop, the race in which
    Python 3.11's asyncio.wait_for returned the result and dropped the cancellation."""

    name = "instant"

    def sample(self):
        return "now"

    def close(self) -> None:
        pass


async def test_stop_ends_every_probe_loop_even_when_a_sample_lands_with_the_cancel() -> None:
    # A dropped cancellation left the probe loop sleeping for ever: the agent that could not
    # bind its port then hung on shutdown instead of exiting 2.
    from mscale.daemon.runner import ProbeRunner

    hung = 0
    for round_ in range(100):
        runner = ProbeRunner(AgentState(node="n"), [(Instant(), 0.0, 5.0) for _ in range(4)])
        runner.start()
        for _ in range(round_ % 7):
            await asyncio.sleep(0)
        stopping = asyncio.ensure_future(runner.stop())
        done, _ = await asyncio.wait({stopping}, timeout=2)
        if not done:
            hung += 1
            for t in runner._asyncio_tasks:
                t.cancel()
    assert hung == 0, f"stop() never returned in {hung} of 100 rounds"
