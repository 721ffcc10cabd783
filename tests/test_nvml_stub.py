"""The real NVML adapter (nvml_api.RealNvml, through nvidia-ml-py's pynvml) against a stand-in
libnvidia-ml.so.1 (tests/fixtures/libnvidia_ml_stub.c, compiled here with gcc). pynvml dlopens
"libnvidia-ml.so.1" by name, so each case runs in a subprocess whose LD_LIBRARY_PATH points at
the stub; the stub's GPUs come from a config file the test writes (format in the C file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support import REPO, free_port, require_tool, stop_process
from support.e2e import http, poll

pytestmark = pytest.mark.slow  # gcc builds the stand-in, a subprocess per case: about 8 s

STUB_C = REPO / "tests" / "fixtures" / "libnvidia_ml_stub.c"

# Builds the GPU probe the way the agent does (the probe registry's factory, through
# build_probes), samples until an Xid has arrived or a deadline, and prints what it saw.
PROBE_SCRIPT = textwrap.dedent(
    """
    import dataclasses, json, sys, time
    from mscale.daemon.config import from_dict
    from mscale.daemon.app import UnavailableProbe, build_probes, new_state
    from mscale.probes.base import ProbeContext

    cfg = from_dict({})
    found = []
    ctx = ProbeContext(config=cfg, emit=found.append, clock=time.time)
    ((probe, _, _),) = build_probes(cfg, ctx, ("gpu",))
    if isinstance(probe, UnavailableProbe):
        print(json.dumps({"unavailable": probe.reason}))
        sys.exit(0)
    want_xids, want_lost = int(sys.argv[1]), int(sys.argv[2])
    deadline = time.monotonic() + 10
    while True:
        snap = probe.sample()
        xids = sum(n for g in snap.gpus for _, n in g.xid_errors)
        lost = sum(g.lost for g in snap.gpus)
        if (xids >= want_xids and lost >= want_lost) or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    probe.close()
    print(json.dumps({
        "backend": snap.backend,
        "gpus": [dataclasses.asdict(g) for g in snap.gpus],
        "findings": [{"reason": str(f.reason.value), "labels": f.labels} for f in found],
    }))
    """
)


@pytest.fixture(scope="module")
def stub_dir(tmp_path_factory) -> Path:
    gcc = require_tool("gcc", why="compiles the stand-in libnvidia-ml.so.1")
    d = tmp_path_factory.mktemp("nvml_stub")
    subprocess.run(
        [
            gcc,
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-o",
            str(d / "libnvidia-ml.so.1"),
            str(STUB_C),
        ],
        check=True,
    )
    return d


def run_probe(stub_dir: Path, tmp_path: Path, config: str, *, want_xids: int = 0, want_lost: int = 0) -> dict:
    """Sample until want_xids Xids have arrived and want_lost GPUs are lost (10 s at most)."""
    cfg = tmp_path / "nvml_stub.conf"
    cfg.write_text(textwrap.dedent(config))
    env = {**os.environ, "LD_LIBRARY_PATH": str(stub_dir), "MSCALE_NVML_STUB_CONFIG": str(cfg)}
    out = subprocess.run(
        [sys.executable, "-c", PROBE_SCRIPT, str(want_xids), str(want_lost)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


FULL_GPU = """
    gpus 2
    gpu 0 uuid GPU-11111111-2222-3333-4444-555555555555
    gpu 0 name NVIDIA H100 80GB HBM3
    gpu 0 temperature 61
    gpu 0 power_mw 350500
    gpu 0 power_limit_mw 700000
    gpu 0 memory_used 1073741824
    gpu 0 memory_total 85899345920
    gpu 0 util_gpu 87
    gpu 0 util_memory 42
    gpu 0 sm_clock 1980
    gpu 0 mem_clock 2619
    gpu 0 throttle 5          # gpu_idle | sw_power_cap
    gpu 0 ecc_sbe_volatile 3
    gpu 0 ecc_dbe_volatile 0
    gpu 0 ecc_sbe_aggregate 12
    gpu 0 ecc_dbe_aggregate 1
    gpu 0 retired_sbe 2
    gpu 0 retired_dbe 1
    gpu 0 retired_pending 1
    gpu 0 remap_corr 4
    gpu 0 remap_unc 0
    gpu 0 remap_pending 0
    gpu 0 remap_failed 0
    gpu 0 pcie_replay 7
    gpu 0 pcie_tx 2048
    gpu 0 pcie_rx 4096
    gpu 0 nvlinks 3
    gpu 0 nvlink_down 1
    gpu 0 nvlink_errors 5 6 7 8
    gpu 0 recovery_action 0
    gpu 1 recovery_action 2   # NODE_REBOOT
"""


def test_every_field_arrives_with_the_stubs_value(stub_dir, tmp_path) -> None:
    out = run_probe(stub_dir, tmp_path, FULL_GPU)
    assert out["backend"] == "nvml"
    g = out["gpus"][0]
    assert {k: g[k] for k in ("index", "uuid", "name", "lost")} == {
        "index": 0,
        "uuid": "GPU-11111111-2222-3333-4444-555555555555",
        "name": "NVIDIA H100 80GB HBM3",
        "lost": False,
    }
    assert g["temperature_c"] == 61.0
    assert g["power_w"] == 350.5 and g["power_limit_w"] == 700.0
    assert (g["memory_used_bytes"], g["memory_total_bytes"]) == (1073741824, 85899345920)
    assert (g["utilization_gpu_ratio"], g["utilization_memory_ratio"]) == (0.87, 0.42)
    assert (g["sm_clock_hz"], g["memory_clock_hz"]) == (1980e6, 2619e6)
    assert g["throttle_reasons"] == ["gpu_idle", "sw_power_cap"]
    assert (g["ecc_sbe_volatile"], g["ecc_dbe_volatile"], g["ecc_sbe_aggregate"], g["ecc_dbe_aggregate"]) == (
        3,
        0,
        12,
        1,
    )
    assert (g["retired_pages_sbe"], g["retired_pages_dbe"], g["retired_pages_pending"]) == (2, 1, True)
    assert (
        g["remapped_rows_correctable"],
        g["remapped_rows_uncorrectable"],
        g["remapped_rows_pending"],
        g["remapped_rows_failed"],
    ) == (4, 0, False, False)
    assert g["pcie_replay_count"] == 7
    assert (g["pcie_tx_bytes_per_second"], g["pcie_rx_bytes_per_second"]) == (2048 * 1024.0, 4096 * 1024.0)
    assert [(link["link"], link["up"]) for link in g["nvlinks"]] == [(0, True), (1, False), (2, True)]
    assert all(
        (link["replay_errors"], link["recovery_errors"], link["crc_flit_errors"], link["crc_data_errors"])
        == (5, 6, 7, 8)
        for link in g["nvlinks"]
    )
    assert g["recovery_action"] == 0
    # The second GPU was given only a recovery action: zeros, a made-up identity, no NVLink.
    g1 = out["gpus"][1]
    assert (g1["uuid"], g1["temperature_c"], g1["nvlinks"], g1["lost"]) == ("GPU-stub-1", 0.0, [], False)
    assert g1["recovery_action"] == 2


def test_a_not_supported_field_is_no_data_not_a_failure(stub_dir, tmp_path) -> None:
    out = run_probe(
        stub_dir,
        tmp_path,
        """
        gpus 1
        gpu 0 temperature 55
        gpu 0 power_mw 100000
        gpu 0 nvlinks 2
        gpu 0 not_supported power
        gpu 0 not_supported remapped_rows
        gpu 0 not_supported recovery_action
        gpu 0 not_supported nvlink_errors
        gpu 0 error pcie_throughput 4   # NO_PERMISSION: also no data
        gpu 0 error ecc 999             # UNKNOWN on a field: no data, the GPU still probed
        """,
    )
    (g,) = out["gpus"]
    assert g["lost"] is False and g["health"] == "healthy"
    assert g["power_w"] is None and g["remapped_rows_correctable"] is None and g["recovery_action"] is None
    assert g["temperature_c"] == 55.0
    assert [link["up"] for link in g["nvlinks"]] == [True, True]
    assert all(link["replay_errors"] is None for link in g["nvlinks"])
    assert g["pcie_tx_bytes_per_second"] is None and g["ecc_sbe_volatile"] is None


def test_a_gpu_lost_at_start_leaves_the_others_probed(stub_dir, tmp_path) -> None:
    out = run_probe(
        stub_dir,
        tmp_path,
        """
        gpus 3
        gpu 0 temperature 50
        gpu 1 lost_at_start
        gpu 2 temperature 52
        """,
    )
    assert "unavailable" not in out, out
    g0, g1, g2 = out["gpus"]
    assert (g0["temperature_c"], g2["temperature_c"]) == (50.0, 52.0)
    assert not g0["lost"] and not g2["lost"]
    assert g1["lost"] is True and g1["health"] == "failed"
    assert "GPU is lost" in g1["lost_reason"]
    assert g1["uuid"] == "GPU-unknown-1"


def test_a_gpu_lost_later_is_reported_lost_and_the_others_still_probed(stub_dir, tmp_path) -> None:
    out = run_probe(
        stub_dir,
        tmp_path,
        """
        gpus 2
        gpu 0 temperature 50
        gpu 1 uuid GPU-later
        gpu 1 temperature 70
        gpu 1 lost_after 0.3
        """,
        want_lost=1,
    )
    g0, g1 = out["gpus"]
    assert (g0["lost"], g0["temperature_c"], g0["health"]) == (False, 50.0, "healthy")
    assert (g1["lost"], g1["health"], g1["uuid"]) == (True, "failed", "GPU-later")  # identity kept from start
    assert "GPU is lost" in g1["lost_reason"]


def test_event_set_wait_delivers_xids_to_the_probe(stub_dir, tmp_path) -> None:
    out = run_probe(
        stub_dir,
        tmp_path,
        """
        gpus 2
        gpu 0 uuid GPU-aaaa
        gpu 1 uuid GPU-bbbb
        xid 1 79
        xid 0 13
        """,
        want_xids=2,
    )
    g0, g1 = out["gpus"]
    assert g1["xid_errors"] == [[79, 1]] and g1["last_xid"] == 79
    assert g0["xid_errors"] == [[13, 1]]
    assert g1["health"] == "failed"  # Xid 79: fallen off the bus
    xid_findings = [f["labels"] for f in out["findings"] if f["reason"] == "gpu_xid"]
    assert {(f["gpu"], f["gpu_uuid"], f["xid"]) for f in xid_findings} == {
        ("1", "GPU-bbbb", "79"),
        ("0", "GPU-aaaa", "13"),
    }


def test_a_gpu_without_xid_events_leaves_the_others_listening(stub_dir, tmp_path) -> None:
    out = run_probe(
        stub_dir,
        tmp_path,
        """
        gpus 2
        gpu 0 not_supported register_events
        xid 1 31
        """,
        want_xids=1,
    )
    assert out["gpus"][1]["xid_errors"] == [[31, 1]]


@pytest.mark.parametrize("code, text", [(999, "Unknown Error"), (2, "Invalid Argument")])
def test_an_event_set_error_takes_the_probe_down_with_the_reason(stub_dir, tmp_path, code, text) -> None:
    out = run_probe(stub_dir, tmp_path, f"gpus 1\nevent_set_create_error {code}\n")
    assert out == {"unavailable": f"NVML Xid events could not be set up: nvmlEventSetCreate: {text}"}


def test_a_register_events_error_takes_the_probe_down_with_the_reason(stub_dir, tmp_path) -> None:
    out = run_probe(stub_dir, tmp_path, "gpus 2\ngpu 1 error register_events 999\n")
    assert out == {"unavailable": "NVML Xid events could not be set up: nvmlDeviceRegisterEvents: Unknown Error"}


def test_an_init_error_is_nvml_not_available(stub_dir, tmp_path) -> None:
    out = run_probe(stub_dir, tmp_path, "gpus 1\ninit_error 9\n")  # DRIVER_NOT_LOADED
    assert out["unavailable"].startswith("NVML not available:")


@pytest.mark.parametrize(
    "config, reason",
    [
        (
            "gpus 2\nevent_set_create_error 999\n",
            "NVML Xid events could not be set up: nvmlEventSetCreate: Unknown Error",
        ),
        ("gpus 2\ninit_error 9\n", "NVML not available: Driver Not Loaded"),
        ("gpus 2\nerror count 999\n", "NVML initialised but listing GPUs failed: Unknown Error"),
        (
            "gpus 2\ngpu 1 error register_events 999\n",
            "NVML Xid events could not be set up: nvmlDeviceRegisterEvents: Unknown Error",
        ),
    ],
    ids=["event_set_create", "init", "count", "register_events"],
)
def test_the_agent_keeps_serving_when_nvml_fails(stub_dir, tmp_path, config, reason) -> None:
    """`mscale agent` on the stand-in (no --simulate): the GPU probe reports down with
    NVML's reason, the agent answers on HTTP and its other probes run."""
    (tmp_path / "nvml_stub.conf").write_text(config)
    (tmp_path / "agent.toml").write_text("[probes.ebpf]\nenabled = false\n")
    port = free_port()
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": str(stub_dir),
        "MSCALE_NVML_STUB_CONFIG": str(tmp_path / "nvml_stub.conf"),
    }
    argv = [sys.executable, "-m", "mscale", "agent", "--config", str(tmp_path / "agent.toml")]
    argv += ["--listen", f"127.0.0.1:{port}", "--socket", str(tmp_path / "agent.sock")]
    log = tmp_path / "agent.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        url = f"http://127.0.0.1:{port}/api/v1/probes"
        probes = poll(
            "the GPU probe's status",
            lambda: (p := http(url))["gpu"]["up"] is not None and p["host"]["up"] is not None and p,
            timeout_s=30,
            logs=log.read_text,
        )
        assert probes["gpu"]["up"] is False
        assert probes["gpu"]["reason"] == f"unavailable: {reason}"
        assert probes["host"]["up"] is True
        assert proc.poll() is None
    finally:
        stop_process(proc)
