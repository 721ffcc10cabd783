"""Adding a probe is one module and one registry line. A throwaway probe (tests/support/
throwaway_probe.py, on by default) and a dormant one (tests/support/dormant_probe.py, off by
default), each registered by one REGISTRY entry, get their [probes.<name>] keys checked like
the shipped probes', `enabled` defaulting to the spec's `default_enabled`, rows in the config
reference, and are run by the agent. The machinery (mscale.options) is a leaf; mscale.daemon.config
assembles the rooms' sections."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from mscale.daemon import keys
from mscale.daemon.app import create_app
from mscale.daemon.config import ConfigError, from_dict, load, reference_markdown
from mscale.probes import REGISTRY
from mscale.probes.base import ProbeSpec
from support import throwaway_probe

SHIPPED_OFF = {"gpu": {"enabled": False}, "host": {"enabled": False}, "ebpf": {"enabled": False}}


@pytest.fixture
def registered(monkeypatch):
    """The one line a contributor adds to mscale/probes/__init__.py, per probe."""
    monkeypatch.setitem(REGISTRY, "throwaway", "support.throwaway_probe")
    monkeypatch.setitem(REGISTRY, "dormant", "support.dormant_probe")


def test_unregistered_probe_has_no_table() -> None:
    with pytest.raises(ConfigError, match=r"^probes\.throwaway: unknown key \(known in \[probes\]: ebpf, gpu, host\)"):
        from_dict({"probes": {"throwaway": {}}})


def test_keys_accepted_with_their_defaults(registered) -> None:
    cfg = from_dict({})
    t = cfg.probes.throwaway
    assert isinstance(t, throwaway_probe.ThrowawaySection)
    assert (t.enabled, t.interval_s, t.timeout_s, t.greeting, t.level) == (True, 0.05, 2.0, "hello", 3)
    assert cfg.probes.dormant.enabled is False  # the spec's default_enabled=False
    assert cfg.probes.gpu.interval_s == 1.0  # the shipped probes are untouched

    cfg = from_dict(
        {
            "probes": {
                "throwaway": {"greeting": "hi", "level": 10, "enabled": False},
                "dormant": {"enabled": True, "interval_s": 1},
            }
        }
    )
    assert (cfg.probes.throwaway.greeting, cfg.probes.throwaway.level, cfg.probes.throwaway.enabled) == (
        "hi",
        10,
        False,
    )
    assert cfg.probes.dormant.enabled is True and cfg.probes.dormant.interval_s == 1.0
    assert dataclasses.replace(cfg.probes.throwaway, level=4).level == 4


@pytest.mark.parametrize(
    "toml,message",
    [
        (
            "[probes.throwaway]\nlevel = 11\n",
            "probes.throwaway.level (line 2): expected a value between 1 and 10, got 11",
        ),
        ("[probes.throwaway]\ngreeting = 3\n", "probes.throwaway.greeting (line 2): expected a string, got int 3"),
        (
            "\n[probes.throwaway]\ngreting = 'hi'\n",
            "probes.throwaway.greting (line 3): unknown key (known in [probes.throwaway]: "
            "enabled, greeting, interval_s, level, timeout_s)",
        ),
        ("[probes.dormant]\nenabled = 'yes'\n", "probes.dormant.enabled (line 2): expected a boolean, got str 'yes'"),
    ],
)
def test_bad_values_refused_naming_key_and_line(registered, tmp_path, toml, message) -> None:
    path = tmp_path / "agent.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as e:
        load(path)
    assert str(e.value) == f"{path}: {message}"


def test_reference_lists_the_new_keys(registered) -> None:
    rows = reference_markdown().splitlines()
    ours = [r for r in rows if r.startswith(("| `probes.throwaway.", "| `probes.dormant."))]
    assert ours == [
        "| `probes.throwaway.enabled` | `true` | run the throwaway probe |",
        "| `probes.throwaway.interval_s` | `0.05` | seconds between throwaway samples (range 0.01..60) |",
        "| `probes.throwaway.timeout_s` | `2.0` | deadline for one sample (range 0.01..60) |",
        "| `probes.throwaway.greeting` | `'hello'` | what the sample says |",
        "| `probes.throwaway.level` | `3` | how loudly it says it (range 1..10) |",
        "| `probes.dormant.enabled` | `false` | run the dormant probe (off unless asked for) |",
        "| `probes.dormant.interval_s` | `0.05` | seconds between dormant samples (range 0.01..60) |",
        "| `probes.dormant.timeout_s` | `2.0` | deadline for one sample (range 0.01..60) |",
    ]
    # after the shipped probes, before [health]: the registry's order
    assert rows.index(ours[0]) > max(i for i, r in enumerate(rows) if r.startswith("| `probes.ebpf."))
    assert rows.index(ours[-1]) < min(i for i, r in enumerate(rows) if r.startswith("| `health."))


async def _run_agent(cfg, until):
    """Serve the agent's app on port 0 and scrape /metrics until `until(metrics)` holds;
    returns the last scrape, the probe status API and the agent's state."""
    app = create_app(cfg, features=("mscale.daemon.api",))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 20
            while True:
                async with session.get(url + "/metrics") as r:
                    metrics = {
                        (s.name, tuple(sorted(s.labels.items()))): s.value
                        for fam in text_string_to_metric_families(await r.text())
                        for s in fam.samples
                    }
                if until(metrics):
                    break
                assert time.monotonic() < deadline, f"not met before the deadline: {metrics}"
                await asyncio.sleep(0.05)
            async with session.get(url + "/api/v1/probes") as r:
                probes = await r.json()
        return metrics, probes, app[keys.STATE]
    finally:
        await runner.cleanup()


def _up(metrics: dict, probe: str) -> float | None:
    return metrics.get(("mscale_probe_up", (("probe", probe),)))


async def test_agent_runs_the_registered_probe(registered) -> None:
    cfg = from_dict({"probes": {**SHIPPED_OFF, "throwaway": {"greeting": "hi there"}}})
    metrics, probes, state = await _run_agent(cfg, lambda m: _up(m, "throwaway") == 1)
    assert state.snapshots["throwaway"].greeting == "hi there"  # its own key reached the probe
    assert probes["throwaway"]["enabled"] is True and probes["throwaway"]["up"] is True
    assert probes["throwaway"]["samples_total"] >= 1
    # off by default: listed as switched off, no meta-metrics, never sampled
    assert probes["dormant"]["enabled"] is False and probes["dormant"]["samples_total"] == 0
    assert _up(metrics, "dormant") is None and "dormant" not in state.snapshots


async def test_default_off_probe_runs_when_enabled(registered) -> None:
    cfg = from_dict({"probes": {**SHIPPED_OFF, "dormant": {"enabled": True}, "throwaway": {"enabled": False}}})
    metrics, probes, state = await _run_agent(cfg, lambda m: _up(m, "dormant") == 1)
    assert state.snapshots["dormant"] == "awake" and probes["dormant"]["enabled"] is True
    assert _up(metrics, "throwaway") is None and probes["throwaway"]["enabled"] is False


@pytest.mark.parametrize(
    "section,error",
    [
        (
            dataclasses.make_dataclass(
                "WithEnabled",
                [("enabled", bool, True), ("interval_s", float, 1.0), ("timeout_s", float, 1.0)],
                frozen=True,
            ),
            "section declares 'enabled'; set default_enabled on the spec instead",
        ),
        (
            dataclasses.make_dataclass("NoDeadline", [("interval_s", float, 1.0)], frozen=True),
            "section lacks timeout_s",
        ),
        (dict, "section must be a dataclass"),
    ],
)
def test_spec_refuses_a_section_the_agent_cannot_run(section, error) -> None:
    with pytest.raises(TypeError, match=error):
        ProbeSpec(name="bad", factory=lambda ctx: None, section=section)


def test_the_machinery_is_a_leaf_and_config_is_assembled_above_the_rooms() -> None:
    """Rooms import mscale.options (opt, ConfigError, parse_bool), which imports no room;
    mscale.daemon.config imports each room's section, and no room imports mscale.daemon.config."""
    code = (
        "import sys, mscale\n"
        "before = set(sys.modules)\n"
        "import mscale.options\n"
        "print(sorted(m for m in set(sys.modules) - before if m.startswith('mscale')))\n"
        "import mscale.daemon.config as c\n"
        "c.from_dict({})\n"
        "print(sorted(m for m in set(sys.modules) - before if m.startswith('mscale')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "['mscale.options']"
    for room in (
        "mscale.daemon.settings",
        "mscale.healing.settings",
        "mscale.probes.gpu_health",
        "mscale.probes.gpu",
        "mscale.probes.host",
        "mscale.probes.ebpf",
    ):
        assert repr(room) in out[1]  # and assembling does reach each room's section
    pkg = Path(__file__).resolve().parent.parent / "mscale"
    config = (pkg / "daemon" / "config.py").read_text()
    assert "import_module" not in config and '"mscale.' not in config  # no string names a room
    importers = sorted(
        str(p.relative_to(pkg))
        for p in pkg.rglob("*.py")
        if "from mscale.daemon.config import" in p.read_text() or "from mscale.daemon import config" in p.read_text()
    )
    # only the agent's assembly and entry points (and a CLI that reads the agent's file) use it
    assert importers == [
        "daemon/app.py",
        "daemon/contract/cli.py",
        "daemon/keys.py",
        "daemon/main.py",
        "demo/embedded.py",
    ]
