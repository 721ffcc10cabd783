"""The real NVML adapter (pynvml over the stand-in libnvidia-ml.so.1) and the simulated GPUs
on one `--simulate` timeline: the same exported GPU health series step by step; partial
NVLink counters; a driver without the recovery-action call; and every NVML error code from
every call class the adapter makes, with the probe surviving each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pynvml
import pytest

from mscale.daemon.config import from_dict
from mscale.findings import Reason
from mscale.probes.gpu import GpuProbe, NvmlReader
from mscale.probes.gpu_health import HealthModel
from mscale.sim.nvml import SimNvml
from mscale.sim.timeline import parse_timeline
from support import REPO, require_tool
from support.nvml_timeline import SteppedClock, compile_timeline, health_series

pytestmark = pytest.mark.slow  # gcc builds the stand-in twice, a subprocess per case

STUB_C = REPO / "tests" / "fixtures" / "libnvidia_ml_stub.c"
TESTS = REPO / "tests"

TIMELINE = """\
gpus: 4
model: h100
events:
  - {at: 1s, gpu: 0, fault: temperature, celsius: 89, ramp: 2s}
  - {at: 1.5s, gpu: 1, fault: xid, code: 48}          # RESET_GPU: failed until reset
  - {at: 2s, gpu: 2, fault: nvlink_down, link: 5}
  - {at: 2s, gpu: 3, fault: xid, code: 13}            # RESTART_APP: health unchanged
  - {at: 2.5s, gpu: 3, fault: ecc_sbe_storm, per_hour: 100000}
  - {at: 3s, gpu: 2, fault: pcie_replay_storm, per_min: 60000}
  - {at: 3.5s, gpu: 3, fault: ecc_dbe, count: 2}
  - {at: 4s, gpu: 2, fault: gpu_lost}
  - {at: 5s, gpu: 1, fault: recover}
  - {at: 6s, gpu: 2, fault: recover}
  - {at: 6.5s, gpu: 0, fault: xid, code: 31337}       # not in the table: degraded
  - {at: 5.5s, gpu: 3, fault: xid, code: 154, recovery_action: 2}   # node reboot required
"""
STEPS = [k * 0.5 for k in range(16)]  # 0 .. 7.5 s

# The real adapter's series, in a process whose LD_LIBRARY_PATH holds the stand-in.
REAL_SERIES = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from support.nvml_timeline import SteppedClock, health_series, write_clock
    from mscale.daemon.config import from_dict
    from mscale.findings import Reason
    from mscale.probes.gpu import GpuProbe, NvmlReader
    from mscale.probes.gpu_health import HealthModel
    from mscale.probes.nvml_api import open_real_nvml
    from mscale.sim.timeline import load_timeline

    timeline, clock_file = load_timeline(sys.argv[2]), Path(sys.argv[3])
    steps, clock = json.loads(sys.argv[4]), SteppedClock(float(sys.argv[5]))

    def set_elapsed(t):
        clock.elapsed = t
        write_clock(clock_file, t)

    set_elapsed(0.0)
    found = []
    reader = NvmlReader(open_real_nvml(), owns=True)
    probe = GpuProbe(reader, HealthModel(from_dict({}).health), emit=found.append, clock=clock, xid_wait_ms=20)
    xids = lambda: sum(f.reason == Reason.GPU_XID for f in found)
    series = health_series(probe, timeline, steps, set_elapsed, xids)
    probe.close()
    print(json.dumps(series))
    """
)


def build_stub(dest: Path, *defines: str) -> Path:
    gcc = require_tool("gcc", why="compiles the stand-in libnvidia-ml.so.1")
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [gcc, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", *(f"-D{d}" for d in defines)]
    subprocess.run([*cmd, "-o", str(dest / "libnvidia-ml.so.1"), str(STUB_C), "-lpthread"], check=True)
    return dest


@pytest.fixture(scope="module")
def stub_dir(tmp_path_factory) -> Path:
    return build_stub(tmp_path_factory.mktemp("nvml_stub"))


@pytest.fixture(scope="module")
def stub_without_field_values(tmp_path_factory) -> Path:
    return build_stub(tmp_path_factory.mktemp("nvml_stub_old"), "STUB_NO_FIELD_VALUES")


def run_in_stub(stub: Path, config: Path, code: str, *args: str, timeout_s: float = 120) -> str:
    env = {**os.environ, "LD_LIBRARY_PATH": str(stub), "MSCALE_NVML_STUB_CONFIG": str(config)}
    out = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout.strip().splitlines()[-1]


def sim_series(timeline_text: str, t0: float) -> list[dict[str, float]]:
    timeline = parse_timeline(timeline_text)
    clock = SteppedClock(t0)
    sim = SimNvml.from_timeline(timeline, clock=clock)
    found: list = []
    probe = GpuProbe(
        NvmlReader(sim, backend="sim"),
        HealthModel(from_dict({}).health),
        emit=found.append,
        clock=clock,
        xid_wait_ms=20,
    )

    def set_elapsed(t: float) -> None:
        clock.elapsed = t

    try:
        return health_series(
            probe, timeline, STEPS, set_elapsed, lambda: sum(f.reason == Reason.GPU_XID for f in found)
        )
    finally:
        probe.close()


def test_real_adapter_on_the_stand_in_and_the_simulated_gpus_export_the_same_series(stub_dir, tmp_path) -> None:
    """One timeline, written once; the stand-in plays its compiled form through NVML's C
    interface and pynvml, the simulated GPUs play it through the Python protocol."""
    (tmp_path / "timeline.yaml").write_text(TIMELINE)
    clock_file = tmp_path / "clock"
    compiled = compile_timeline(parse_timeline(TIMELINE, "timeline.yaml"), STEPS, clock_file=clock_file)
    (tmp_path / "stub.conf").write_text(compiled)
    t0 = 1_800_000_000.0
    real = json.loads(
        run_in_stub(
            stub_dir,
            tmp_path / "stub.conf",
            REAL_SERIES,
            str(TESTS),
            str(tmp_path / "timeline.yaml"),
            str(clock_file),
            json.dumps(STEPS),
            str(t0),
        )
    )
    sim = sim_series(TIMELINE, t0)
    assert len(real) == len(sim) == len(STEPS)
    for t, r, s in zip(STEPS, real, sim, strict=True):
        only_real = {k: r[k] for k in r.keys() - s.keys()}
        only_sim = {k: s[k] for k in s.keys() - r.keys()}
        differ = {k: (r[k], s[k]) for k in r.keys() & s.keys() if r[k] != s[k]}
        assert (only_real, only_sim, differ) == ({}, {}, {}), f"at {t}s (real, sim)"

    # The series is not trivially equal: the faults show in it.
    uuid = {i: SimNvml.from_timeline(parse_timeline(TIMELINE)).uuids[i] for i in range(4)}

    def value(step: float, name: str, gpu: int, **labels: str) -> float | None:
        every = {"gpu": str(gpu), "gpu_uuid": uuid[gpu], **labels}
        key = name + "{" + ",".join(f"{k}={v}" for k, v in sorted(every.items())) + "}"
        return real[STEPS.index(step)].get(key)

    assert value(0.0, "mscale_gpu_health", 1, state="healthy") == 1.0
    assert value(2.0, "mscale_gpu_health", 1, state="failed") == 1.0  # Xid 48
    assert value(2.0, "mscale_gpu_recovery_action", 1) == 1.0  # gpu_reset
    assert value(5.0, "mscale_gpu_health", 1, state="healthy") == 1.0  # reset seen
    assert value(2.0, "mscale_gpu_xid_errors_total", 3, xid="13", action="RESTART_APP") == 1.0
    assert value(2.0, "mscale_gpu_health", 3, state="healthy") == 1.0
    assert value(3.5, "mscale_gpu_health", 3, state="failed") == 1.0  # double-bit ECC
    assert value(4.0, "mscale_gpu_lost", 2) == 1.0
    assert value(6.0, "mscale_gpu_lost", 2) == 0.0
    assert value(2.5, "mscale_gpu_nvlink_up", 2, link="5") == 0.0
    assert value(3.0, "mscale_gpu_temperature_celsius", 0) == 89.0
    assert value(7.0, "mscale_gpu_xid_errors_total", 0, xid="31337", action="UNLISTED") == 1.0
    assert value(7.0, "mscale_gpu_health", 0, state="degraded") == 1.0
    # Xid 154: the simulated driver's line is parsed; on NVML the field is read with the event
    assert value(5.5, "mscale_gpu_xid_errors_total", 3, xid="154", action="RESTART_BM") == 1.0
    assert value(5.5, "mscale_gpu_recovery_action", 3) == 2.0


# Builds the GPU probe as the agent does and samples once per step of the clock file.
PROBE_STEPS = textwrap.dedent(
    """
    import dataclasses, json, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from support.nvml_timeline import write_clock
    from mscale.daemon.config import from_dict
    from mscale.daemon.app import UnavailableProbe, build_probes, new_state
    from mscale.probes.base import ProbeContext

    cfg = from_dict({})
    clock_file, steps = Path(sys.argv[2]), json.loads(sys.argv[3])
    write_clock(clock_file, 0.0)
    found = []
    ctx = ProbeContext(config=cfg, emit=found.append, clock=time.time)
    ((probe, _, _),) = build_probes(cfg, ctx, ("gpu",))
    samples = []
    for t, want_xids in steps:
        write_clock(clock_file, t)
        deadline = time.monotonic() + 10
        while sum(f.reason.value == "gpu_xid" for f in found) < want_xids and time.monotonic() < deadline:
            time.sleep(0.01)
        samples.append([dataclasses.asdict(g) for g in probe.sample().gpus])
    probe.close()
    print(json.dumps(samples))
    """
)


def probe_steps(stub: Path, tmp_path: Path, config: str, steps: list[tuple[float, int]]) -> list[list[dict]]:
    clock_file = tmp_path / "clock"
    conf = tmp_path / "stub.conf"
    conf.write_text(f"clock_file {clock_file}\n" + textwrap.dedent(config))
    out = run_in_stub(stub, conf, PROBE_STEPS, str(TESTS), str(clock_file), json.dumps(steps))
    return json.loads(out)


def test_one_unsupported_nvlink_counter_leaves_the_other_three(stub_dir, tmp_path) -> None:
    (samples,) = probe_steps(
        stub_dir,
        tmp_path,
        """
        gpus 1
        gpu 0 nvlinks 2
        gpu 0 link 0 errors 1 2 3 4
        gpu 0 link 1 errors 5 6 7 8
        gpu 0 not_supported nvlink_crc_flit
        """,
        [(0.0, 0)],
    )
    links = samples[0]["nvlinks"]
    got = [(lk["replay_errors"], lk["recovery_errors"], lk["crc_flit_errors"], lk["crc_data_errors"]) for lk in links]
    assert got == [(1, 2, None, 4), (5, 6, None, 8)]


@pytest.mark.parametrize("how", ["not_exported", "not_supported"])
def test_without_the_recovery_action_call_a_fatal_xid_clears_on_a_seen_reset(
    stub_dir, stub_without_field_values, tmp_path, how
) -> None:
    """No recovery action: a reset shows as the volatile ECC counters going back to zero."""
    stub = stub_without_field_values if how == "not_exported" else stub_dir
    samples = probe_steps(
        stub,
        tmp_path,
        f"""
        gpus 2
        gpu 0 ecc_sbe_volatile 5
        gpu 1 ecc_sbe_volatile 5
        {"gpu 0 not_supported recovery_action" if how == "not_supported" else ""}
        at 1 xid 0 48
        at 2 gpu 0 ecc_sbe_volatile 0   # nvidia-smi -r: volatile counters start again
        """,
        [(0.0, 0), (1.0, 1), (2.0, 1)],
    )
    health = [s[0]["health"] for s in samples]
    assert [s[0]["recovery_action"] for s in samples] == [None, None, None]
    assert health == ["healthy", "failed", "healthy"]
    assert [s[1]["health"] for s in samples] == ["healthy"] * 3


def test_without_the_recovery_action_call_a_fatal_xid_holds_without_a_seen_reset(
    stub_without_field_values, tmp_path
) -> None:
    samples = probe_steps(
        stub_without_field_values, tmp_path, "gpus 1\nat 1 xid 0 48\n", [(0.0, 0), (1.0, 1), (3.0, 1)]
    )
    assert [s[0]["health"] for s in samples] == ["healthy", "failed", "failed"]  # the hold is an hour


# Every NVML error code the adapter can see, from every call class it makes: the probe is
# built and sampled as the agent does, never raises, and says what happened.
ERROR_LOOP = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    import pynvml
    from mscale.daemon.config import from_dict
    from mscale.daemon.app import UnavailableProbe, build_probes, new_state
    from mscale.probes.base import ProbeContext

    conf = Path(os.environ["MSCALE_NVML_STUB_CONFIG"])
    cfg = from_dict({})
    results = []
    for where, call, code in json.loads(sys.argv[1]):
        line = {"global": f"error {call} {code}", "init": f"init_error {code}",
                "event_set_create": f"event_set_create_error {code}"}.get(where, f"gpu 1 error {call} {code}")
        conf.write_text("gpus 2\\ngpu 0 temperature 50\\ngpu 1 temperature 60\\ngpu 0 nvlinks 1\\n"
                        "gpu 1 nvlinks 1\\nxid 1 13\\n" + line + "\\n")
        ctx = ProbeContext(config=cfg, emit=lambda f: None, clock=time.time)
        ((probe, _, _),) = build_probes(cfg, ctx, ("gpu",))
        if isinstance(probe, UnavailableProbe):
            results.append({"unavailable": probe.reason})
            continue
        first, second = probe.sample(), probe.sample()
        probe.close()
        g0, g1 = second.gpus
        results.append({"g0": [g0.lost, g0.temperature_c], "g1": {
            "lost": g1.lost, "lost_reason": g1.lost_reason, "temperature_c": g1.temperature_c,
            "power_w": g1.power_w, "uuid": g1.uuid, "name": g1.name, "ecc": g1.ecc_sbe_volatile,
            "links": [[lk.up, lk.replay_errors, lk.crc_flit_errors] for lk in g1.nvlinks],
            "recovery_action": g1.recovery_action, "rows": g1.remapped_rows_correctable,
            "health": g1.health}})
    conf.write_text("gpus 1\\n")
    pynvml.nvmlInit()  # each code's text as pynvml prints it with the stand-in loaded
    texts = {code: str(pynvml.NVMLError(code)) for _, _, code in json.loads(sys.argv[1])}
    pynvml.nvmlShutdown()
    print(json.dumps({"results": results, "texts": texts}))
    """
)

CODES = sorted({v for k, v in vars(pynvml).items() if k.startswith("NVML_ERROR_")} - {pynvml.NVML_ERROR_GPU_IS_LOST})
# per-GPU call classes -> what the GPU sample shows when that call fails (not GPU_IS_LOST)
FIELD_CALLS = {
    "temperature": "temperature_c",
    "power": "power_w",
    "ecc": "ecc",
    "remapped_rows": "rows",
    "recovery_action": "recovery_action",
    "field_values": "recovery_action",
    "name": "name",
}
OTHER_CALLS = [
    "power_limit",
    "memory",
    "utilization",
    "clocks",
    "throttle",
    "retired_pages",
    "pcie_replay",
    "pcie_throughput",
    "nvlink_errors",
    "nvlink_replay",
    "nvlink_state",
    "index",
]


def test_every_nvml_error_code_from_every_call_class_leaves_the_probe_standing(stub_dir, tmp_path) -> None:
    cases = [("init", "init", c) for c in CODES]
    cases += [("global", "count", c) for c in CODES] + [("global", "event_wait", c) for c in CODES]
    cases += [("event_set_create", "event_set_create", c) for c in CODES]
    cases += [("gpu", call, c) for call in ("handle", "uuid", "register_events") for c in CODES]
    cases += [("gpu", call, c) for call in [*FIELD_CALLS, *OTHER_CALLS] for c in CODES]
    conf = tmp_path / "stub.conf"
    conf.write_text("gpus 1\n")
    out = json.loads(run_in_stub(stub_dir, conf, ERROR_LOOP, json.dumps(cases), timeout_s=600))
    results, texts = out["results"], {int(k): v for k, v in out["texts"].items()}
    assert len(results) == len(cases)
    assert texts[999] == "Unknown Error" and texts[30] == "NVML error 30"  # the stand-in's strings
    for (where, call, code), got in zip(cases, results, strict=True):
        text = texts[code]
        case = f"{call} answering {code} ({text})"
        if where == "init":
            assert got == {"unavailable": f"NVML not available: {text}"}, case
        elif call == "count":
            assert got == {"unavailable": f"NVML initialised but listing GPUs failed: {text}"}, case
        elif where == "event_set_create":
            assert got == {"unavailable": f"NVML Xid events could not be set up: nvmlEventSetCreate: {text}"}, case
        elif call == "register_events" and code != pynvml.NVML_ERROR_NOT_SUPPORTED:
            assert got == {"unavailable": f"NVML Xid events could not be set up: nvmlDeviceRegisterEvents: {text}"}, (
                case
            )
        else:
            assert "unavailable" not in got, case
            assert got["g0"] == [False, 50.0], case  # the other GPU is read as usual
            g1 = got["g1"]
            if call == "handle":  # a GPU that cannot be opened is reported lost with NVML's reason
                assert (g1["lost"], g1["health"], g1["uuid"]) == (True, "failed", "GPU-unknown-1"), case
                assert g1["lost_reason"] == text, case
                continue
            assert g1["lost"] is False, case
            if call == "uuid":
                assert g1["uuid"] == "GPU-unknown-1" and g1["temperature_c"] == 60.0, case
            elif call in FIELD_CALLS:
                assert g1[FIELD_CALLS[call]] in (None, ""), case  # no data, not a failure
                assert g1["temperature_c"] == (None if call == "temperature" else 60.0), case
            elif call == "nvlink_errors":
                assert g1["links"] == [[True, None, None]], case
            elif call == "nvlink_replay":
                assert g1["links"] == [[True, None, 0]], case
            elif call == "nvlink_state":
                assert g1["links"] == [], case
            else:
                assert g1["temperature_c"] == 60.0, case
