"""The GPU probe against the simulated GPUs: every field, every health rule, Xid events,
a lost GPU; the Nvml protocol the real adapter and the simulation share; the Xid table;
the GPU exporter's series."""

from __future__ import annotations

import dataclasses
import inspect
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mscale.daemon.config import from_dict
from mscale.daemon.exporters import make_registry
from mscale.daemon.state import AgentState
from mscale.findings import Finding, Reason, Severity
from mscale.healing import policy as policymod
from mscale.healing.engine import Condition, HealingEngine, Target
from mscale.healing.settings import HealingSection
from mscale.probes import nvml_api
from mscale.probes.gpu import GpuProbe, GpuSnapshot, NvmlReader
from mscale.probes.gpu_health import (
    HealthModel,
    XidTableError,
    load_xid_table,
    parse_xid_table,
    shipped_xid_table,
    xid_markdown,
)
from mscale.probes.nvml_api import Nvml, NvmlUnavailable, RealNvml, XidEventSource
from mscale.sim.nvml import SimNvml
from mscale.sim.timeline import FaultEvent, event_from_dict, parse_timeline

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


class Clock:
    """A clock the test moves; the simulation and the probe both read it."""

    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@dataclasses.dataclass
class Rig:
    sim: SimNvml
    probe: GpuProbe
    clock: Clock
    found: list[Finding]

    def inject(self, fault: str, gpu: int, **params) -> None:
        self.sim.inject(event_from_dict({"gpu": gpu, "fault": fault, **params}, gpus=self.sim.device_count()))

    def sample(self) -> GpuSnapshot:
        return self.probe.sample()

    def until(self, pred: Callable[[GpuSnapshot], bool], timeout_s: float = 10.0) -> GpuSnapshot:
        """Sample until pred holds (the Xid thread delivers asynchronously)."""
        deadline = time.monotonic() + timeout_s
        while True:
            snap = self.sample()
            if pred(snap):
                return snap
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met; last snapshot: {snap}")
            time.sleep(0.01)

    def findings(self, reason: Reason, gpu: int | None = None) -> list[Finding]:
        return [f for f in self.found if f.reason is reason and (gpu is None or f.labels.get("gpu") == str(gpu))]


@pytest.fixture
def make_rig():
    rigs = []

    def make(gpus: int = 8, model: str = "h100", events: tuple[FaultEvent, ...] = (), **health) -> Rig:
        clock = Clock()
        sim = SimNvml(gpus, model=model, events=events, clock=clock)
        cfg = from_dict({"health": health})
        found: list[Finding] = []
        probe = GpuProbe(
            NvmlReader(sim, backend="sim"), HealthModel(cfg.health), emit=found.append, clock=clock, xid_wait_ms=50
        )
        rig = Rig(sim, probe, clock, found)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.probe.close()


# --- the protocol -------------------------------------------------------------------------

PROTOCOL_METHODS = [n for n, v in vars(Nvml).items() if callable(v) and not n.startswith("_")]


def test_protocol_lists_the_calls_we_use() -> None:
    assert {"device_count", "temperature_c", "ecc_errors", "remapped_rows", "nvlink_up", "xid_events", "close"} <= set(
        PROTOCOL_METHODS
    )


@pytest.mark.parametrize("impl", [RealNvml, SimNvml])
def test_adapters_implement_the_protocol_signatures(impl) -> None:
    for name in PROTOCOL_METHODS:
        want = list(inspect.signature(getattr(Nvml, name)).parameters.values())
        got = list(inspect.signature(getattr(impl, name)).parameters.values())
        assert [(p.name, p.kind) for p in got] == [(p.name, p.kind) for p in want], f"{impl.__name__}.{name}"


def test_sim_is_an_nvml_and_its_events_a_source() -> None:
    sim = SimNvml(2)
    assert isinstance(sim, Nvml)
    src = sim.xid_events()
    assert isinstance(src, XidEventSource)
    assert src.wait(1) is None
    src.close()


def test_real_nvml_opens_or_says_why() -> None:
    try:
        nvml = nvml_api.open_real_nvml()
    except NvmlUnavailable as e:  # this machine has no NVIDIA driver
        assert "NVML not available" in str(e)
    else:  # a GPU node: the adapter answers through the protocol
        try:
            assert nvml.device_count() >= 1 and nvml.uuid(0).startswith("GPU-")
        finally:
            nvml.close()


def test_gpu_lost_raises_nvmls_own_error_kind() -> None:
    sim = SimNvml(2)
    sim.inject(FaultEvent(0, 1, "gpu_lost"))
    with pytest.raises(nvml_api.NVMLError) as err:
        sim.temperature_c(1)
    assert nvml_api.is_gpu_lost(err.value) and type(err.value).__name__ == "NVMLError_GpuIsLost"
    assert sim.temperature_c(0) > 0


# --- fields -----------------------------------------------------------------------------


def test_every_field_on_a_healthy_h100(make_rig) -> None:
    rig = make_rig()
    snap = rig.sample()
    assert snap.backend == "sim" and len(snap.gpus) == 8
    assert len({g.uuid for g in snap.gpus}) == 8
    for g in snap.gpus:
        assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", g.uuid)
        assert g.name == "NVIDIA H100 80GB HBM3"
        assert (g.health, g.reasons, g.lost) == ("healthy", (), False)
        assert 40 <= g.temperature_c < 70
        assert 0 < g.power_w <= g.power_limit_w == 700.0
        assert g.memory_total_bytes == 81559 * MiB and 0 < g.memory_used_bytes < g.memory_total_bytes
        assert 0.9 <= g.utilization_gpu_ratio <= 1.0 and 0 < g.utilization_memory_ratio < 1.0
        assert g.sm_clock_hz == 1980e6 and g.memory_clock_hz == 2619e6
        assert g.throttle_reasons == ()
        assert (g.ecc_sbe_volatile, g.ecc_dbe_volatile, g.ecc_sbe_aggregate, g.ecc_dbe_aggregate) == (0, 0, 0, 0)
        # H100s remap rows instead of retiring pages: NOT_SUPPORTED is no data, not a failure.
        assert (g.retired_pages_sbe, g.retired_pages_dbe, g.retired_pages_pending) == (None, None, None)
        assert (
            g.remapped_rows_correctable,
            g.remapped_rows_uncorrectable,
            g.remapped_rows_pending,
            g.remapped_rows_failed,
        ) == (0, 0, False, False)
        assert g.pcie_replay_count == 0
        assert g.pcie_tx_bytes_per_second > 1e9 and g.pcie_rx_bytes_per_second > 1e9
        assert [link.link for link in g.nvlinks] == list(range(18))
        assert all(
            link.up
            and (link.replay_errors, link.recovery_errors, link.crc_flit_errors, link.crc_data_errors) == (0, 0, 0, 0)
            for link in g.nvlinks
        )
        assert g.recovery_action == nvml_api.RECOVERY_NONE
        assert g.xid_errors == () and g.last_xid is None
    assert rig.found == []


def test_h200_figures(make_rig) -> None:
    g = make_rig(gpus=2, model="h200").sample().gpus[1]
    assert g.name == "NVIDIA H200" and g.memory_total_bytes == 143771 * MiB and g.memory_clock_hz == 3201e6


def test_snapshot_is_frozen(make_rig) -> None:
    snap = make_rig(gpus=1).sample()
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.gpus[0].health = "failed"  # type: ignore[misc]


# --- health rules ------------------------------------------------------------------------


def test_fatal_xid_fails_the_gpu_once_and_a_reset_clears_it(make_rig) -> None:
    rig = make_rig()
    rig.sample()
    rig.inject("xid", 3, code=79)
    snap = rig.until(lambda s: s.gpus[3].xid_errors == ((79, 1),))
    g = snap.gpus[3]
    assert g.health == "failed" and g.last_xid == 79
    assert any("Xid 79" in r and "fallen off the bus" in r for r in g.reasons)
    assert g.recovery_action == nvml_api.RECOVERY_GPU_RESET
    assert [s.health for i, s in enumerate(snap.gpus) if i != 3] == ["healthy"] * 7
    xids = rig.findings(Reason.GPU_XID)
    assert len(xids) == 1 and xids[0].severity is Severity.CRITICAL
    assert xids[0].labels == {"gpu": "3", "gpu_uuid": g.uuid, "xid": "79", "xid_class": "fatal", "action": "RESTART_BM"}
    assert "drain the node" in xids[0].message
    assert rig.findings(Reason.GPU_HEALTH_CHANGED) == []  # the Xid's finding already said so
    for _ in range(3):
        assert rig.sample().gpus[3].health == "failed"  # sticky until the GPU is reset
    rig.inject("recover", 3)
    g = rig.sample().gpus[3]
    assert g.health == "healthy" and g.xid_errors == ((79, 1),)  # the counter stays
    assert len(rig.findings(Reason.GPU_RECOVERED, 3)) == 1


@pytest.mark.parametrize(
    "code,health,severity",
    [
        (142, "degraded", Severity.WARNING),  # CONTACT_SUPPORT
        (63, "healthy", Severity.INFO),  # IGNORE: a row remap that worked
        (94, "healthy", Severity.INFO),  # RESTART_APP: the application's fault, not the GPU's
        (109, "failed", Severity.CRITICAL),  # RESET_GPU
        (13, "healthy", Severity.INFO),
        (43, "healthy", Severity.INFO),
        (48, "failed", Severity.CRITICAL),
        (999, "degraded", Severity.WARNING),
    ],
)
def test_xid_classes(make_rig, code, health, severity) -> None:
    rig = make_rig(gpus=2)
    rig.inject("xid", 1, code=code)
    g = rig.until(lambda s: s.gpus[1].xid_errors == ((code, 1),)).gpus[1]
    assert g.health == health
    (f,) = rig.findings(Reason.GPU_XID, 1)
    assert f.severity is severity


def test_repeated_xids_count_each(make_rig) -> None:
    rig = make_rig(gpus=2)
    for _ in range(3):
        rig.inject("xid", 0, code=13)
    rig.inject("xid", 0, code=31)
    snap = rig.until(lambda s: s.gpus[0].xid_errors == ((13, 3), (31, 1)))
    assert snap.gpus[0].last_xid == 31 and len(rig.findings(Reason.GPU_XID)) == 4


def test_degrading_xid_expires_after_the_hold(make_rig) -> None:
    rig = make_rig(gpus=1, xid_degraded_hold_s=60)
    rig.inject("xid", 0, code=142)
    rig.until(lambda s: s.gpus[0].health == "degraded")
    rig.clock.advance(30)
    assert rig.sample().gpus[0].health == "degraded"
    rig.clock.advance(31)
    assert rig.sample().gpus[0].health == "healthy"
    assert len(rig.findings(Reason.GPU_RECOVERED)) == 1


def test_double_bit_ecc_fails_until_reset(make_rig) -> None:
    rig = make_rig(gpus=2)
    rig.sample()
    rig.inject("ecc_dbe", 1)
    g = rig.sample().gpus[1]
    assert g.health == "failed"
    assert (g.ecc_dbe_volatile, g.ecc_dbe_aggregate, g.remapped_rows_uncorrectable, g.remapped_rows_pending) == (
        1,
        1,
        1,
        True,
    )
    assert any("double-bit" in r for r in g.reasons) and any("needs a reset" in r for r in g.reasons)
    (dbe,) = rig.findings(Reason.GPU_ECC_DBE, 1)
    assert dbe.severity is Severity.CRITICAL and dbe.labels["health"] == "failed"
    assert len(rig.findings(Reason.GPU_RESET_REQUIRED, 1)) == 1
    rig.inject("recover", 1)
    g = rig.sample().gpus[1]
    assert g.health == "healthy" and (g.ecc_dbe_volatile, g.ecc_dbe_aggregate, g.remapped_rows_pending) == (0, 1, False)


def test_single_bit_storm_degrades_and_a_trickle_does_not(make_rig) -> None:
    rig = make_rig(gpus=2)
    rig.sample()
    rig.inject("ecc_sbe_storm", 0, per_hour=500)
    rig.inject("ecc_sbe_storm", 1, per_hour=50)
    for _ in range(60):  # ten simulated minutes, a sample every 10 s
        rig.clock.advance(10)
        snap = rig.sample()
    storm, trickle = snap.gpus
    assert storm.ecc_sbe_volatile == storm.ecc_sbe_aggregate == 83  # 500/h for 600 s
    assert storm.health == "degraded" and storm.sbe_per_hour > 100
    assert any("single-bit ECC" in r for r in storm.reasons)
    assert trickle.ecc_sbe_volatile == 8 and trickle.health == "healthy" and trickle.sbe_per_hour < 100
    assert len(rig.findings(Reason.GPU_ECC_SBE_STORM, 0)) == 1 and rig.findings(Reason.GPU_ECC_SBE_STORM, 1) == []


def test_sbe_threshold_comes_from_config(make_rig) -> None:
    rig = make_rig(gpus=1, sbe_per_hour_degraded=1000)
    rig.inject("ecc_sbe_storm", 0, per_hour=500)
    for _ in range(60):
        rig.clock.advance(10)
        g = rig.sample().gpus[0]
    assert g.sbe_per_hour > 100 and g.health == "healthy"


def test_temperature_ramp_throttles_and_degrades(make_rig) -> None:
    rig = make_rig(gpus=2)
    start = rig.sample().gpus[1].temperature_c
    rig.inject("temperature", 1, celsius=92, ramp="4s")
    rig.clock.advance(2)
    mid = rig.sample().gpus[1]
    assert start < mid.temperature_c < 92
    rig.clock.advance(2)
    hot = rig.sample().gpus[1]
    assert hot.temperature_c == 92 and hot.health == "degraded"
    assert set(hot.throttle_reasons) == {"sw_thermal_slowdown", "hw_thermal_slowdown"}
    assert hot.sm_clock_hz < 1980e6
    (f,) = rig.findings(Reason.GPU_TEMPERATURE, 1)
    assert f.severity is Severity.WARNING and "92 C >= 83 C" in f.message
    rig.inject("recover", 1)
    cool = rig.sample().gpus[1]
    assert cool.health == "healthy" and cool.throttle_reasons == () and cool.sm_clock_hz == 1980e6


def test_temperature_threshold_is_inclusive_and_configurable(make_rig) -> None:
    rig = make_rig(gpus=1, temperature_degraded_c=88)
    rig.inject("temperature", 0, celsius=87)
    assert rig.sample().gpus[0].health == "healthy"
    rig.inject("temperature", 0, celsius=88)
    assert rig.sample().gpus[0].health == "degraded"


def test_nvlink_never_seen_up_is_not_down(make_rig) -> None:
    rig = make_rig(gpus=1)
    rig.inject("nvlink_down", 0, link=5)  # before the first reading: as on a board where it is not wired
    g = rig.sample().gpus[0]
    assert not g.nvlinks[5].up and g.health == "healthy"


def test_nvlink_down_degrades(make_rig) -> None:
    rig = make_rig(gpus=5)
    rig.sample()
    rig.inject("nvlink_down", 4, link=2)
    g = rig.sample().gpus[4]
    assert g.health == "degraded" and "NVLink link 2 is down" in g.reasons
    link2 = g.nvlinks[2]
    assert not link2.up and link2.recovery_errors == 1
    assert all(link.up for link in g.nvlinks if link.link != 2)
    assert len(rig.findings(Reason.GPU_NVLINK_DOWN, 4)) == 1


def test_pcie_replay_storm_degrades(make_rig) -> None:
    rig = make_rig(gpus=1)
    rig.sample()
    rig.inject("pcie_replay_storm", 0, per_min=600)
    for _ in range(12):
        rig.clock.advance(10)
        g = rig.sample().gpus[0]
    assert g.pcie_replay_count == 1200 and g.health == "degraded" and g.pcie_replays_per_min > 100
    assert len(rig.findings(Reason.GPU_PCIE_REPLAY)) == 1


def test_lost_gpu_is_reported_not_crashed_on(make_rig) -> None:
    rig = make_rig(gpus=4)
    uuid = rig.sample().gpus[2].uuid
    rig.inject("gpu_lost", 2)
    snap = rig.sample()
    g = snap.gpus[2]
    assert g.lost and g.health == "failed" and g.uuid == uuid and "GPU is lost" in g.lost_reason
    assert g.temperature_c is None and g.nvlinks == ()
    assert [s.health for s in snap.gpus if s.index != 2] == ["healthy"] * 3
    (f,) = rig.findings(Reason.GPU_LOST, 2)
    assert f.severity is Severity.CRITICAL
    rig.inject("recover", 2)
    g = rig.sample().gpus[2]
    assert not g.lost and g.health == "healthy" and g.temperature_c is not None


def test_timeline_events_apply_as_the_clock_passes(make_rig) -> None:
    events = (
        FaultEvent(2.0, 3, "xid", code=79),
        FaultEvent(5.0, 1, "temperature", celsius=88, ramp_s=3.0),
        FaultEvent(9.0, 1, "recover"),
    )
    rig = make_rig(events=events)
    rig.clock.advance(1.9)
    assert rig.sample().gpus[3].xid_errors == ()
    rig.clock.advance(0.2)
    rig.until(lambda s: s.gpus[3].health == "failed")
    rig.clock.advance(6)  # t = 8.1: GPU 1 is hot
    assert rig.sample().gpus[1].health == "degraded"
    rig.clock.advance(1)  # t = 9.1: recovered
    assert rig.sample().gpus[1].health == "healthy"
    assert [e.fault for _, e in rig.sim.applied] == ["xid", "temperature", "recover"]


def test_findings_only_on_transitions(make_rig) -> None:
    rig = make_rig(gpus=2)
    rig.sample()
    rig.inject("nvlink_down", 0, link=1)
    for _ in range(5):
        rig.sample()
    rig.inject("nvlink_down", 0, link=3)  # a second reason while already degraded
    for _ in range(5):
        rig.sample()
    assert [f.labels["cause"] for f in rig.findings(Reason.GPU_NVLINK_DOWN)] == ["nvlink:1", "nvlink:3"]
    assert len(rig.found) == 2


# --- the Xid table -------------------------------------------------------------------------


def test_shipped_xid_table_classes() -> None:
    t = load_xid_table()
    classes = {code: t.classify(code).cls for code in (79, 48, 63, 64, 74, 94, 95, 13, 31, 43)}
    assert classes == {
        79: "fatal",
        48: "fatal",
        63: "info",
        64: "fatal",
        74: "fatal",
        94: "info",
        95: "fatal",
        13: "info",
        31: "info",
        43: "info",
    }
    assert t.classify(12345).cls == "degrading"
    # NVIDIA's immediate actions (issue 13), and the documented default for unlisted codes
    actions = {code: t.classify(code).action for code in (109, 94, 69, 8, 13, 31, 32, 68, 74, 79, 12345)}
    assert actions == {
        109: "RESET_GPU",
        94: "RESTART_APP",
        69: "RESTART_APP",
        8: "RESTART_APP",
        13: "RESTART_APP",
        31: "RESTART_APP",
        32: "RESTART_APP",
        68: "RESTART_APP",
        74: "WORKFLOW_NVLINK_ERR",
        79: "RESTART_BM",
        12345: "UNLISTED",
    }
    assert {t.classify(c).applies_to for c in (57, 58, 61)} == {"before A100"}


def test_shipped_xid_table_header_names_its_source() -> None:
    text = (REPO / "mscale" / "probes" / "xid_table.csv").read_text()
    header = text.split("\ncode,class,", 1)[0]
    assert all(line.startswith("#") for line in header.splitlines())
    assert "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html" in header
    assert re.search(r"read \d{4}-\d{2}-\d{2}", header)


V2 = "code,class,action,applies_to,description\n"


def test_action_columns_parse_and_a_legacy_table_gets_the_class_action() -> None:
    t = parse_xid_table("# a comment\n" + V2 + "13,info,RESTART_APP,,x\n74,fatal,WORKFLOW_XID_74,A100 H100,y\n")
    assert (t.classify(13).action, t.classify(74).action, t.classify(74).applies_to) == (
        "RESTART_APP",
        "WORKFLOW_XID_74",
        "A100 H100",
    )
    legacy = parse_xid_table("code,class,description\n79,fatal,x\n13,info,y\n63,degrading,z\n")
    assert [legacy.classify(c).action for c in (79, 13, 63)] == ["RESET_GPU", "IGNORE", "CONTACT_SUPPORT"]


@pytest.mark.parametrize(
    "body,line,words",
    [
        ("code,class,description\n79,fatal,x\nabc,fatal,y\n", 3, ["code", "'abc'"]),
        ("code,class,description\n79,terrible,x\n", 2, ["class", "'terrible'"]),
        ("code,class,description\n79,fatal,x\n79,info,y\n", 3, ["listed twice"]),
        ("# comment\ncode,klass,description\n", 2, ["header"]),
        ("code,class,description\n79,fatal\n", 2, ["3 columns"]),
        ("code,class,description\n79,fatal,\n", 2, ["description"]),
        (V2 + "79,fatal,REBOOT,,x\n", 2, ["action", "'REBOOT'"]),
        (V2 + "79,info,RESET_GPU,,x\n", 2, ["class", "RESET_GPU needs the class fatal"]),
        (V2 + "13,fatal,RESTART_APP,,x\n", 2, ["RESTART_APP needs the class info"]),
        (V2 + "13,info,IGNORE,A100;rm,x\n", 2, ["applies_to"]),
        (V2 + "13,info,IGNORE,x\n", 2, ["5 columns"]),
    ],
)
def test_bad_xid_tables_name_the_line(body, line, words) -> None:
    with pytest.raises(XidTableError) as err:
        parse_xid_table(body, "x.csv")
    assert str(err.value).startswith(f"x.csv line {line}:")
    for w in words:
        assert w in str(err.value)


def test_docs_document_the_xid_table() -> None:
    doc = (REPO / "docs" / "xid.md").read_text()
    m = re.search(r"<!-- xid-table:begin[^>]*-->\n(.*?)<!-- xid-table:end -->", doc, re.S)
    assert m, "docs/xid.md has no xid-table markers"
    assert m.group(1) == xid_markdown(), (
        "docs/xid.md is stale: paste the output of "
        "`python -c 'from mscale.probes.gpu_health import xid_markdown; print(xid_markdown(), end=\"\")'` "
        "between its markers"
    )


# --- the exporter ----------------------------------------------------------------------------


def scrape(state: AgentState) -> dict:
    text = generate_latest(make_registry(state, modules=("mscale.daemon.exporters.gpu",))).decode()
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_exporter_series(make_rig) -> None:
    rig = make_rig(gpus=4)
    rig.sample()  # NVLink-down means a link seen up is now down
    rig.inject("xid", 3, code=79)
    rig.inject("nvlink_down", 1, link=2)
    rig.inject("temperature", 2, celsius=91)
    snap = rig.until(lambda s: s.gpus[3].xid_errors)
    state = AgentState(node="n")
    state.publish("gpu", snap)
    m = scrape(state)
    uuid3 = snap.gpus[3].uuid
    health = {(lb["gpu"], lb["state"]): v for lb, v in m["mscale_gpu_health"]}
    assert health[("3", "failed")] == 1 and health[("3", "healthy")] == 0 and health[("3", "degraded")] == 0
    assert health[("0", "healthy")] == 1 and health[("1", "degraded")] == 1
    assert sum(health.values()) == 4
    assert m["mscale_gpu_xid_errors_total"] == [
        ({"gpu": "3", "gpu_uuid": uuid3, "xid": "79", "action": "RESTART_BM"}, 1.0)
    ]
    assert all(set(lb) >= {"gpu", "gpu_uuid"} for name, series in m.items() for lb, _ in series)
    temps = {lb["gpu"]: v for lb, v in m["mscale_gpu_temperature_celsius"]}
    assert temps["2"] == 91
    assert {lb["gpu"]: v for lb, v in m["mscale_gpu_memory_total_bytes"]}["0"] == 81559 * MiB
    assert {lb["gpu"]: v for lb, v in m["mscale_gpu_sm_clock_hertz"]}["0"] == 1980e6
    assert {lb["link"]: v for lb, v in m["mscale_gpu_nvlink_up"] if lb["gpu"] == "1"}["2"] == 0
    link_errors = {(lb["gpu"], lb["type"]): v for lb, v in m["mscale_gpu_nvlink_errors_total"]}
    assert link_errors[("1", "recovery")] == 1 and link_errors[("0", "recovery")] == 0 and len(link_errors) == 4 * 4
    throttled = {lb["reason"] for lb, v in m["mscale_gpu_clocks_throttled"] if lb["gpu"] == "2" and v == 1}
    assert throttled == {"sw_thermal_slowdown", "hw_thermal_slowdown"}
    ecc = {(lb["type"], lb["counter"]) for lb, _ in m["mscale_gpu_ecc_errors_total"]}
    assert ecc == {
        ("single_bit", "volatile"),
        ("double_bit", "volatile"),
        ("single_bit", "aggregate"),
        ("double_bit", "aggregate"),
    }
    for name in (
        "mscale_gpu_power_watts",
        "mscale_gpu_utilization_ratio",
        "mscale_gpu_pcie_replays_total",
        "mscale_gpu_pcie_throughput_bytes_per_second",
        "mscale_gpu_remapped_rows",
        "mscale_gpu_lost",
        "mscale_gpu_recovery_action",
        "mscale_gpu_nvlink_errors_total",
        "mscale_gpu_info",
    ):
        assert name in m, name
    assert "mscale_gpu_retired_pages" not in m  # not supported on H100: no series rather than a fake 0


def test_exporter_with_a_lost_gpu(make_rig) -> None:
    rig = make_rig(gpus=2)
    rig.inject("gpu_lost", 1)
    state = AgentState(node="n")
    state.publish("gpu", rig.sample())
    m = scrape(state)
    assert {lb["gpu"]: v for lb, v in m["mscale_gpu_lost"]} == {"0": 0.0, "1": 1.0}
    assert [lb["gpu"] for lb, _ in m["mscale_gpu_temperature_celsius"]] == ["0"]


def test_no_snapshot_no_gpu_series() -> None:
    assert not any(k.startswith("mscale_gpu_") for k in scrape(AgentState(node="n")))


@pytest.mark.parametrize("at", ["0s", "0", "1s"])
def test_timeline_xid_at_start_is_counted(make_rig, at) -> None:
    """An Xid at 0s is applied by the reader's first NVML call, before the probe listens for
    Xid events: it must still be heard (it was lost once), and only once."""
    (ev,) = parse_timeline(f"events:\n  - {{at: {at}, gpu: 2, fault: xid, code: 79}}\n").events
    rig = make_rig(events=(ev,))
    rig.clock.advance(1.0)
    snap = rig.until(lambda s: s.gpus[2].xid_errors == ((79, 1),))
    assert snap.gpus[2].health == "failed" and len(rig.findings(Reason.GPU_XID)) == 1
    for _ in range(3):
        rig.sample()
    assert rig.sample().gpus[2].xid_errors == ((79, 1),)


# --- NVIDIA's immediate action per Xid drives health and healing (issue 13 item 4) --------

_BY_ACTION = {
    action: sorted(c for c, x in shipped_xid_table().entries.items() if x.action == action)
    for action in ("RESET_GPU", "RESTART_APP")
}


@pytest.mark.parametrize(
    "code,action", [(c, a) for a, codes in _BY_ACTION.items() for c in codes], ids=lambda v: str(v)
)
def test_catalogue_action_maps_to_the_matching_healing_action(make_rig, code, action) -> None:
    """Every Xid the table lists as RESET_GPU or RESTART_APP: the probe's finding, through the
    shipped healing policy and the real engine, leads to the matching response."""
    rig = make_rig(gpus=2)
    rig.inject("xid", 1, code=code)
    g = rig.until(lambda s: s.gpus[1].xid_errors == ((code, 1),)).gpus[1]
    (f,) = rig.findings(Reason.GPU_XID, 1)
    assert f.labels["action"] == action and g.xid_actions == ((code, action),)
    eng = HealingEngine(policymod.load(""), HealingSection())
    cond = Condition.of(f)
    rule = eng.match(cond)
    assert rule is not None
    done = [d.action for d in eng.decide(cond, lambda r, c: [Target("j1", "001", 1, g.uuid)], rule)]
    if action == "RESET_GPU":  # swap off and quarantine the GPU until it resets
        assert g.health == "failed" and rule.name == "gpu_fatal"
        assert {"quarantine_gpu", "l1_swap"} <= set(done), done
    else:  # RESTART_APP: the GPU stays in service; the job recovers in-process
        assert g.health == "healthy" and rule.name == "gpu_xid_restart_app"
        assert "rollback" in done and "quarantine_gpu" not in done and "l1_swap" not in done, done


# NVIDIA's Xid catalogue (the revision xid_table.csv's header cites): every code whose
# "Resolution Bucket (Immediate Action)" is RESET_GPU or RESTART_APP on a generation it lists
CATALOGUE_RESET_GPU = {46, 62, 64, 95, 109, 110, 119, 120, 136, 140, 143, 155, 156, 158}
CATALOGUE_RESTART_APP = {8, 11, 13, 25, 31, 32, 39, 40, 41, 60, 68, 69, 70, 71, 72, 75, 76, 77, 80}
CATALOGUE_RESTART_APP |= {82, 83, 84, 85, 86, 88, 89, 94, *range(96, 106), *range(126, 136), 139}


def test_the_table_lists_every_catalogue_reset_gpu_and_restart_app_code() -> None:
    """So the parametrised test above covers the catalogue's codes, not just the table's."""
    assert set(_BY_ACTION["RESET_GPU"]) == CATALOGUE_RESET_GPU
    assert set(_BY_ACTION["RESTART_APP"]) == CATALOGUE_RESTART_APP


def test_unlisted_and_ignored_xids_change_no_healing(make_rig) -> None:
    rig = make_rig(gpus=2)
    rig.inject("xid", 1, code=999)
    rig.inject("xid", 1, code=45)
    rig.until(lambda s: len(s.gpus[1].xid_errors) == 2)
    eng = HealingEngine(policymod.load(""), HealingSection())
    by_code = {f.labels["xid"]: f for f in rig.findings(Reason.GPU_XID, 1)}
    assert by_code["999"].labels["action"] == "UNLISTED" and by_code["45"].labels["action"] == "WORKFLOW_XID_45"
    assert [eng.match(Condition.of(f)) for f in by_code.values()] == [None, None]


# --- Xid 154: the recovery action it names decides (issue 13 item 4) -----------------------


@pytest.mark.parametrize(
    "value,action,health,rule",
    [
        (1, "RESET_GPU", "failed", "gpu_fatal"),  # gpu_reset
        (2, "RESTART_BM", "failed", "gpu_fatal"),  # node_reboot
        (4, "RESET_GPU", "failed", "gpu_fatal"),  # drain_and_reset
        (3, "CONTACT_SUPPORT", "degraded", None),  # drain_p2p
        (0, "IGNORE", "healthy", None),  # none
    ],
)
def test_xid_154_takes_the_recovery_action_it_names(make_rig, value, action, health, rule) -> None:
    rig = make_rig(gpus=2)
    rig.sim.inject(FaultEvent(0, 1, "xid", code=154, recovery_action=value))
    g = rig.until(lambda s: s.gpus[1].xid_errors == ((154, 1),)).gpus[1]
    (f,) = rig.findings(Reason.GPU_XID, 1)
    name = nvml_api.RECOVERY_ACTIONS[value]
    assert (f.labels["action"], f.labels["recovery_action"], g.xid_actions) == (action, name, ((154, action),))
    assert g.health == health and g.recovery_action == value
    matched = HealingEngine(policymod.load(""), HealingSection()).match(Condition.of(f))
    assert (matched.name if matched else None) == rule


def test_xid_154_message_is_parsed_and_a_bad_one_falls_back() -> None:
    from mscale.probes.gpu_health import parse_recovery_action
    from mscale.sim.nvml import recovery_message

    assert parse_recovery_action(recovery_message(0, 2)) == 2
    assert (
        parse_recovery_action(
            "NVRM: Xid (PCI:0000:97:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"
        )
        == 1
    )
    assert parse_recovery_action("GPU recovery action changed from 0x0 (None) to 0x7 (OS Reboot)") == 2  # by its name
    assert parse_recovery_action("GPU recovery action changed from 0x0 (None) to 0x9 (Something New)") is None
    assert parse_recovery_action("Xid 154 with no action in it") is None
    model = HealthModel(from_dict({}).health)
    assert model.judge_xid(154, "garbled", recovery_action=4).action == "RESET_GPU"  # the field, then
    assert model.judge_xid(154, "garbled").action == "IGNORE"  # the table's row: nothing to act on
    assert model.judge_xid(154, recovery_message(1, 0), recovery_action=2).action == "IGNORE"  # text first


@pytest.mark.parametrize("how", ["xid_79", "xid_154_node_reboot"])
def test_restart_bm_asks_every_job_on_the_node_to_save_and_the_node_to_drain(make_rig, how) -> None:
    """RESTART_BM: beside the GPU's own response (gpu_fatal), a node_drain_required finding
    whose rule has every job on the node write its newest snapshot to disk."""
    rig = make_rig(gpus=2)
    if how == "xid_79":
        rig.inject("xid", 1, code=79)
    else:
        rig.sim.inject(FaultEvent(0, 1, "xid", code=154, recovery_action=2))
    rig.until(lambda s: len(s.gpus[1].xid_errors) == 1)
    (drain,) = rig.findings(Reason.NODE_DRAIN_REQUIRED)
    assert drain.severity is Severity.CRITICAL and drain.labels["gpu"] == "1" and "drain the node" in drain.message
    eng = HealingEngine(policymod.load(""), HealingSection())
    cond = Condition.of(drain)
    rule = eng.match(cond)
    assert rule is not None and rule.name == "node_drain" and rule.target == "job"
    jobs = [Target("job-on-gpu-1"), Target("job-elsewhere")]  # every job the node runs
    done = [(d.target.job_id, d.action) for d in eng.decide(cond, lambda r, c: jobs, rule)]
    assert done == [("job-on-gpu-1", "emergency_snapshot"), ("job-elsewhere", "emergency_snapshot")]
    # a RESET_GPU Xid is the GPU's affair alone
    rig.inject("xid", 0, code=46)
    rig.until(lambda s: len(s.gpus[0].xid_errors) == 1)
    assert len(rig.findings(Reason.NODE_DRAIN_REQUIRED)) == 1
