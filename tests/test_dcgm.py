"""dcgm-exporter input: fixture pages in dcgm-exporter's exposition format, served by a real
aiohttp server on 127.0.0.1, read by the GPU probe (backend = "dcgm") into the same samples
and health model as NVML.

page1/page2.prom are legacy pages (exporter 4.8.x and earlier: MHz, MiB, percent).
page*_4.9.0.prom and page*_4.10.0.prom are the same GPUs and readings as exporter 4.9.0 and
4.10.0 publish them, written from the published field lists cited in
mscale/probes/dcgm_fields.csv: DCGM 4.7 names, clocks in hertz, memory in bytes (and
DCGM_FI_DEV_FB_CAPACITY_BYTES), utilization as a 0-1 ratio, the DCGM_FI_SYSTEM_DRIVER_VERSION
and hostname labels; 4.10.0 adds DCGM_FI_PROF_PCIE_{TX,RX}_BYTES_PER_SECOND.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from aiohttp import web

from mscale.daemon.config import from_dict
from mscale.daemon.state import AgentState
from mscale.findings import Finding, Reason
from mscale.probes import gpu as gpu_probe
from mscale.probes.base import ProbeContext
from mscale.probes.dcgm import DcgmError, DcgmFieldsError, DcgmReader, parse_fields, parse_page, shipped_fields
from support import REPO, free_port

FIXTURES = Path(__file__).parent / "fixtures" / "dcgm"
MiB = 1 << 20
UUID0 = "GPU-604ac76c-d9cf-fef3-62e9-d92044ab6e52"
UUID1 = "GPU-9a3f1e2b-7c41-4d8e-a1b0-5e6f7a8b9c0d"

XID_COUNT_PAGE = """\
# HELP DCGM_EXP_XID_ERRORS_COUNT Count of XID Errors within user-specified time window (see xid-count-window-size param).
# TYPE DCGM_EXP_XID_ERRORS_COUNT gauge
DCGM_EXP_XID_ERRORS_COUNT{gpu="0",UUID="%s",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",window_size_in_ms="300000",xid="%s"} %d
# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).
# TYPE DCGM_FI_DEV_GPU_TEMP gauge
DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="%s",device="nvidia0",modelName="NVIDIA H100 80GB HBM3"} 55
"""


class Exporter:
    """A real HTTP server on 127.0.0.1 (its own thread and loop) serving `self.page`."""

    def __init__(self) -> None:
        self.page = ""
        self.url = ""
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text=self.page, content_type="text/plain")

        async def start() -> None:
            app = web.Application()
            app.router.add_get("/metrics", metrics)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}/metrics"
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())

    def __enter__(self) -> Exporter:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture
def exporter():
    with Exporter() as e:
        e.page = (FIXTURES / "page1.prom").read_text()
        yield e


def make_probe(url: str) -> tuple[gpu_probe.GpuProbe, list[Finding]]:
    cfg = from_dict({"probes": {"gpu": {"backend": "dcgm", "dcgm_url": url}}})
    found: list[Finding] = []
    state = AgentState(node="n")
    probe = gpu_probe.SPEC.factory(
        ProbeContext(config=cfg, emit=found.append, clock=lambda: 1000.0, jobs=state.registered_jobs)
    )
    return probe, found


def test_fields_from_the_fixture(exporter) -> None:
    probe, found = make_probe(exporter.url)
    try:
        snap = probe.sample()
    finally:
        probe.close()
    assert snap.backend == "dcgm" and [g.index for g in snap.gpus] == [0, 1]
    g0, g1 = snap.gpus
    assert (g0.uuid, g1.uuid) == (UUID0, UUID1) and g0.name == "NVIDIA H100 80GB HBM3"
    assert g0.temperature_c == 61 and g0.power_w == 512.25 and g0.power_limit_w == 700
    assert g0.memory_used_bytes == 70780 * MiB and g0.memory_total_bytes == (70780 + 10240 + 539) * MiB
    assert (g0.utilization_gpu_ratio, g0.utilization_memory_ratio) == (0.97, 0.61)
    assert (g0.sm_clock_hz, g0.memory_clock_hz) == (1980e6, 2619e6)
    assert g0.throttle_reasons == () and set(g1.throttle_reasons) == {"sw_power_cap", "sw_thermal_slowdown"}
    assert (g1.ecc_sbe_volatile, g1.ecc_dbe_volatile, g1.ecc_sbe_aggregate, g1.ecc_dbe_aggregate) == (2, 0, 17, 1)
    assert (g0.retired_pages_sbe, g0.retired_pages_dbe, g0.retired_pages_pending) == (0, 0, False)
    assert (
        g1.remapped_rows_correctable,
        g1.remapped_rows_uncorrectable,
        g1.remapped_rows_pending,
        g1.remapped_rows_failed,
    ) == (2, 1, False, False)
    assert g1.pcie_replay_count == 3
    assert (g0.pcie_tx_bytes_per_second, g0.pcie_rx_bytes_per_second) == (3276800000, 5222400000)
    # Health from the same model: GPU 1 at 84 C is degraded; the aggregate DBE from its past is not a failure.
    assert g0.health == "healthy" and g1.health == "degraded"
    assert g1.reasons == ("temperature 84 C >= 83 C",)
    assert [f.reason for f in found] == [Reason.GPU_TEMPERATURE]


def test_xid_and_double_bit_error_fail_the_gpu(exporter) -> None:
    probe, found = make_probe(exporter.url)
    try:
        probe.sample()
        exporter.page = (FIXTURES / "page2.prom").read_text()
        snap = probe.sample()
        again = probe.sample()  # the same last-Xid value is not a new Xid
    finally:
        probe.close()
    g1 = snap.gpus[1]
    assert g1.health == "failed" and g1.xid_errors == ((48, 1),) and g1.last_xid == 48
    assert any("Xid 48" in r for r in g1.reasons) and any("double-bit" in r for r in g1.reasons)
    assert g1.remapped_rows_pending is True
    assert snap.gpus[0].health == "healthy"
    assert again.gpus[1].xid_errors == ((48, 1),)
    xids = [f for f in found if f.reason is Reason.GPU_XID]
    assert len(xids) == 1 and xids[0].labels["gpu_uuid"] == UUID1 and xids[0].labels["xid"] == "48"
    assert {f.reason for f in found} >= {Reason.GPU_ECC_DBE, Reason.GPU_RESET_REQUIRED}


def test_xid_count_collector_counts_each(exporter) -> None:
    exporter.page = XID_COUNT_PAGE % (UUID0, 79, 1, UUID0)
    probe, found = make_probe(exporter.url)
    try:
        assert probe.sample().gpus[0].xid_errors == ((79, 1),)
        exporter.page = XID_COUNT_PAGE % (UUID0, 79, 3, UUID0)
        snap = probe.sample()
    finally:
        probe.close()
    assert snap.gpus[0].xid_errors == ((79, 3),) and snap.gpus[0].health == "failed"
    assert len([f for f in found if f.reason is Reason.GPU_XID]) == 3


def test_gpu_gone_from_the_page_is_lost(exporter) -> None:
    probe, found = make_probe(exporter.url)
    try:
        probe.sample()
        exporter.page = (
            "\n".join(line for line in (FIXTURES / "page1.prom").read_text().splitlines() if 'gpu="1"' not in line)
            + "\n"
        )
        snap = probe.sample()
    finally:
        probe.close()
    g1 = snap.gpus[1]
    assert g1.lost and g1.health == "failed" and g1.uuid == UUID1
    assert any(f.reason is Reason.GPU_LOST for f in found)


def test_unreachable_endpoint_is_an_error_naming_it() -> None:
    url = f"http://127.0.0.1:{free_port()}/metrics"  # a port nothing listens on
    reader = DcgmReader(url, timeout_s=2)
    with pytest.raises(DcgmError, match="cannot read dcgm-exporter at http://127.0.0.1"):
        reader.read()


def test_garbage_page_is_an_error(exporter) -> None:
    exporter.page = "this is { not prometheus\n"
    with pytest.raises(DcgmError, match="exposition"):
        DcgmReader(exporter.url).read()


# ---- exporter releases: 4.8.x (legacy), 4.9.0 (DCGM 4.7 names and base units), 4.10.0 ----

RELEASE_PAGES = {"legacy": "", "4.9.0": "_4.9.0", "4.10.0": "_4.10.0"}


def page(n: int, release: str) -> str:
    return (FIXTURES / f"page{n}{RELEASE_PAGES[release]}.prom").read_text()


def sample_page(exporter: Exporter, *texts: str):
    probe, found = make_probe(exporter.url)
    try:
        snaps = []
        for text in texts:
            exporter.page = text
            snaps.append(probe.sample())
    finally:
        probe.close()
    return snaps, found


def test_fixture_pages_use_each_releases_names() -> None:
    """The new-release fixtures really carry the renamed set (else the next test proves nothing)."""
    legacy, new49, new410 = page(1, "legacy"), page(1, "4.9.0"), page(1, "4.10.0")
    assert "DCGM_FI_DEV_SM_CLOCK{" in legacy and "DCGM_FI_DEV_SM_CLOCK{" not in new49 + new410
    for text in (new49, new410):
        assert "DCGM_FI_DEV_SM_CLOCK_HERTZ{" in text and "DCGM_FI_DEV_FB_USED_BYTES{" in text
        assert "DCGM_FI_DEV_GPU_UTIL_RATIO{" in text and "DCGM_FI_DEV_FB_CAPACITY_BYTES{" in text
        assert "DCGM_FI_DRIVER_VERSION=" not in text and "DCGM_FI_SYSTEM_DRIVER_VERSION=" in text
    assert "DCGM_FI_PROF_PCIE_TX_BYTES{" in new49 and "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND{" in new410


@pytest.mark.parametrize("release", ["4.9.0", "4.10.0"])
def test_every_exporter_release_gives_the_same_samples(exporter, release) -> None:
    (legacy,), found_legacy = sample_page(exporter, page(1, "legacy"))
    (new,), found_new = sample_page(exporter, page(1, release))
    assert new.gpus == legacy.gpus  # every field, health and reasons included
    g0 = new.gpus[0]
    assert g0.sm_clock_hz == 1980e6 and g0.utilization_gpu_ratio == 0.97
    assert g0.memory_used_bytes == 70780 * MiB and g0.memory_total_bytes == (70780 + 10240 + 539) * MiB
    assert g0.pcie_tx_bytes_per_second == 3276800000 and new.gpus[1].remapped_rows_uncorrectable == 1
    assert [f.reason for f in found_new] == [f.reason for f in found_legacy] == [Reason.GPU_TEMPERATURE]


@pytest.mark.parametrize("release", ["4.9.0", "4.10.0"])
def test_xid_and_dbe_on_a_new_release_page(exporter, release) -> None:
    (_, snap, again), found = sample_page(exporter, page(1, release), page(2, release), page(2, release))
    g1 = snap.gpus[1]
    assert g1.health == "failed" and g1.xid_errors == ((48, 1),) and g1.last_xid == 48
    assert g1.remapped_rows_pending is True and g1.ecc_dbe_volatile == 1
    assert again.gpus[1].xid_errors == ((48, 1),)
    assert len([f for f in found if f.reason is Reason.GPU_XID]) == 1


def _with_line(text: str, metric: str, value: str) -> str:
    """text plus one more sample of `metric` for GPU 0, with GPU 0's labels."""
    labels = next(line for line in text.splitlines() if line.startswith("DCGM_FI_DEV_GPU_TEMP")).split("{")[1]
    labels = labels.split("}")[0]
    return text + f"# TYPE {metric} gauge\n{metric}{{{labels}}} {value}\n"


def test_a_mixed_page_reads_the_newest_releases_name(exporter) -> None:
    """A 4.9+ exporter with a custom collector file can list a legacy name beside the new one:
    the newest release's name wins for that field, and a field only present under a legacy
    name is still read (in its legacy unit)."""
    text = _with_line(page(1, "4.10.0"), "DCGM_FI_DEV_SM_CLOCK", "1000")  # legacy MHz, a different reading
    text = _with_line(text, "DCGM_FI_PROF_PCIE_TX_BYTES", "7")  # the 4.9.0 name beside 4.10.0's
    text = text.replace("DCGM_FI_DEV_MEMORY_UTIL_RATIO", "DCGM_FI_DEV_MEM_COPY_UTIL")  # now a legacy name ...
    text = text.replace("} 0.61\n", "} 61\n")  # ... in its legacy unit
    (snap,), _ = sample_page(exporter, text)
    g0 = snap.gpus[0]
    assert g0.sm_clock_hz == 1980e6 and g0.pcie_tx_bytes_per_second == 3276800000
    assert g0.utilization_memory_ratio == 0.61


@pytest.mark.parametrize("release", ["legacy", "4.9.0", "4.10.0"])
def test_driver_version_from_either_label(release) -> None:
    gpus = parse_page(page(1, release))
    assert {g["driver_version"] for g in gpus.values()} == {"550.90.07"}


def test_shipped_field_table_prefers_the_newest_name() -> None:
    fields = shipped_fields()
    assert [n.name for n in fields["pcie_tx_bytes_per_second"]] == [
        "DCGM_FI_PROF_PCIE_TX_BYTES_PER_SECOND",
        "DCGM_FI_PROF_PCIE_TX_BYTES",
    ]
    clock = fields["sm_clock_hz"]
    assert [(n.name, n.num, n.den) for n in clock] == [
        ("DCGM_FI_DEV_SM_CLOCK_HERTZ", 1, 1),
        ("DCGM_FI_DEV_SM_CLOCK", 1_000_000, 1),
    ]
    assert [(n.num, n.den) for n in fields["utilization_gpu_ratio"]] == [(1, 1), (1, 100)]


HEADER = "field,name,since,scale,source\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no rows"),
        ("name,field\n", "line 1: expected the header"),
        (HEADER + "sm_clock,DCGM_FI_DEV_SM_CLOCK,legacy,1,x\n", "line 2: field: expected one of"),
        (HEADER + "sm_clock_hz,dcgm_sm_clock,legacy,1,x\n", "line 2: name: expected a DCGM_FI_"),
        (HEADER + "sm_clock_hz,DCGM_FI_DEV_SM_CLOCK,4.8,1,x\n", "line 2: since: expected one of"),
        (HEADER + "sm_clock_hz,DCGM_FI_DEV_SM_CLOCK,legacy,0.000001,x\n", "line 2: scale: expected"),
        (HEADER + "sm_clock_hz,DCGM_FI_DEV_SM_CLOCK,legacy,1/0,x\n", "line 2: scale: expected"),
        (HEADER + "sm_clock_hz,DCGM_FI_DEV_SM_CLOCK,legacy,1,\n", "line 2: source: expected"),
        (HEADER + "sm_clock_hz,DCGM_FI_DEV_SM_CLOCK,legacy,1\n", "line 2: expected 5 columns"),
        (
            HEADER
            + "sm_clock_hz,DCGM_FI_DEV_SM_CLOCK,legacy,1,x\n# c\nmemory_clock_hz,DCGM_FI_DEV_SM_CLOCK,legacy,1,x\n",
            "line 4: name DCGM_FI_DEV_SM_CLOCK is listed twice",
        ),
    ],
)
def test_malformed_field_table_names_the_line(text, message) -> None:
    with pytest.raises(DcgmFieldsError, match=message):
        parse_fields(text, "t.csv")


# ---- the shipped rules and dashboards read the agent's metrics, never an exporter's ----

SHIPPED = [
    *sorted((REPO / "mscale" / "rules").glob("*.yml")),
    *sorted((REPO / "mscale" / "rules").glob("*.yaml")),
    *sorted((REPO / "mscale" / "dashboards" / "json").glob("*.json")),
    *sorted(p for p in (REPO / "deploy").rglob("*") if p.is_file()),
]


def test_no_shipped_rule_or_dashboard_reads_an_exporter_name() -> None:
    """Rules and dashboards query mscale_gpu_* (the agent normalises every exporter release
    into one name and unit), so an exporter upgrade cannot blind them: no file reads a
    DCGM_FI_* name, legacy or renamed."""
    renamed = {n.name for names in shipped_fields().values() for n in names}
    assert len(SHIPPED) > 10 and any(p.suffix == ".json" for p in SHIPPED)
    for path in SHIPPED:
        text = path.read_text(errors="replace")
        assert "DCGM_FI_" not in text, f"{path.relative_to(REPO)} reads a dcgm-exporter metric"
        assert not renamed & set(text.split()), path
    rules = (REPO / "mscale" / "rules" / "mscale-alerts.yml").read_text()
    assert "mscale_gpu_" in rules  # the names they do read
