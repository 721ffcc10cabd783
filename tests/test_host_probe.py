"""Host probe: a fixture procfs tree for exact values, the live machine, and a real training-like
child process registered as a job (CPU, RSS, I/O)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mscale.daemon.exporters import make_registry
from mscale.daemon.state import AgentState
from mscale.probes.host import HostProbe, HostSnapshot, whole_disks

PROC = Path(__file__).parent / "fixtures" / "host" / "proc"


def test_fixture_tree_exact_values() -> None:
    saved = psutil.PROCFS_PATH
    snap = HostProbe(proc_root=str(PROC)).sample()
    assert psutil.PROCFS_PATH == saved  # the fixture root was set for the sample only
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = dict(snap.cpu_seconds)
    assert cpu["user"] == 1000 / ticks and cpu["system"] == 300 / ticks and cpu["idle"] == 50000 / ticks
    assert cpu["iowait"] == 40 / ticks and cpu["steal"] == 5 / ticks
    assert snap.memory_total_bytes == 16384000 * 1024
    assert snap.memory_available_bytes == 8192000 * 1024
    assert snap.memory_used_bytes == (16384000 - 8192000) * 1024
    disks = {d.device: d for d in snap.disks}
    assert sorted(disks) == ["nvme0n1", "sda"]  # no partitions, no loop/zram
    nvme = disks["nvme0n1"]
    assert (nvme.reads, nvme.writes) == (1000, 2000)
    assert (nvme.read_bytes, nvme.written_bytes) == (200000 * 512, 400000 * 512)
    assert nvme.io_time_s == 1.5
    nics = {n.interface: n for n in snap.nics}
    ib = nics["ib0"]
    assert (ib.receive_bytes, ib.transmit_bytes, ib.receive_packets, ib.transmit_packets) == (
        987654321,
        123456789,
        123456,
        65432,
    )
    assert (ib.receive_errors, ib.receive_drops, ib.transmit_errors, ib.transmit_drops) == (2, 3, 4, 5)
    assert nics["lo"].receive_bytes == 7205


@pytest.mark.parametrize(
    "names,whole",
    [
        (["sda", "sda1", "sda2", "nvme0n1", "nvme0n1p1", "loop0", "zram0", "vda"], ["nvme0n1", "sda", "vda"]),
        (["nvme1n1", "nvme10n1", "md0", "dm-0"], ["dm-0", "md0", "nvme10n1", "nvme1n1"]),
    ],
)
def test_whole_disks(names, whole) -> None:
    assert whole_disks(names) == whole


def test_live_machine() -> None:
    before = psutil.net_io_counters(pernic=True)["lo"].bytes_recv
    snap = HostProbe().sample()
    assert isinstance(snap, HostSnapshot)
    assert snap.cpus == os.cpu_count()
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    assert snap.memory_total_bytes == int(meminfo["MemTotal"].split()[0]) * 1024
    assert 0 < snap.memory_available_bytes <= snap.memory_total_bytes
    lo = {n.interface: n for n in snap.nics}["lo"]
    assert lo.receive_bytes >= before
    for d in snap.disks:
        assert not d.device.startswith(("loop", "zram", "ram"))
    assert sum(s for _, s in snap.cpu_seconds) > 0


CHILD = r"""
import os, sys, time
block = bytearray(96 * 1024 * 1024)           # resident: touch every page
for i in range(0, len(block), 4096):
    block[i] = 1
with open(sys.argv[1], "wb") as f:            # storage I/O
    f.write(os.urandom(4 * 1024 * 1024))
    f.flush()
    os.fsync(f.fileno())
deadline = time.process_time() + 0.5          # CPU
while time.process_time() < deadline:
    pass
print("ready", flush=True)
sys.stdin.read()                              # hold until the test closes stdin
"""


def test_registered_training_process(tmp_path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "data.bin")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        state = AgentState(node="n")
        state.jobs["job-7"] = SimpleNamespace(job_id="job-7", rank=0, pid=child.pid, mpus={})
        state.jobs["job-gone"] = SimpleNamespace(job_id="job-gone", rank=0, pid=_dead_pid(), mpus={})
        probe = HostProbe(jobs=lambda: list(state.jobs.values()))
        snap = probe.sample()
        (p,) = snap.processes
        assert (p.job_id, p.pid) == ("job-7", child.pid)
        assert p.rss_bytes >= 96 * 1024 * 1024
        assert p.cpu_user_s + p.cpu_system_s >= 0.4
        assert p.written_bytes >= 4 * 1024 * 1024
        assert p.threads >= 1
        assert snap.processes_gone == ("job-gone",)
        state.publish("host", snap)
        text = generate_latest(make_registry(state, modules=("mscale.daemon.exporters.host",))).decode()
        series = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
        }
        labels = (("job_id", "job-7"), ("pid", str(child.pid)))
        assert series[("mscale_process_resident_memory_bytes", labels)] == p.rss_bytes
        assert series[("mscale_process_written_bytes_total", labels)] == p.written_bytes
        assert (
            series[("mscale_process_cpu_seconds_total", labels[:1] + (("mode", "user"),) + labels[1:])] == p.cpu_user_s
        )
        assert ("mscale_host_network_receive_bytes_total", (("interface", "lo"),)) in series
        assert any(name == "mscale_host_cpu_seconds_total" for name, _ in series)
        assert series[("mscale_host_memory_total_bytes", ())] == snap.memory_total_bytes
    finally:
        child.stdin.close()
        child.wait(10)
    # The job's process ended: the next sample says so instead of failing.
    later = probe.sample()
    assert later.processes == () and set(later.processes_gone) == {"job-7", "job-gone"}


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid
