"""Strict configuration: bad files stop `mscale agent` with exit 2 and a message naming the key;
the table in docs/configuration.md and the example deploy/agent.toml stay in step with the code."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest

from mscale import config as configmod
from mscale.config import ConfigError, from_dict, load, parse_bool, reference_markdown
from support import REPO


def run_agent(tmp_path, toml: str, *, listen: str = "127.0.0.1:0") -> subprocess.CompletedProcess:
    path = tmp_path / "agent.toml"
    path.write_text(toml)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mscale",
            "agent",
            "--config",
            str(path),
            "--listen",
            listen,
            "--socket",
            str(tmp_path / "a.sock"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )


BAD = [
    # (file, words the message must contain)
    ("[probes.gpu]\ninterval = 2\n", ["probes.gpu.interval", "line 2", "unknown key", "interval_s"]),
    ("[agnet]\nlisten = '127.0.0.1:1'\n", ["agnet", "unknown key"]),
    ("[probes.gpu]\ninterval_s = 'fast'\n", ["probes.gpu.interval_s", "line 2", "expected a number", "'fast'"]),
    ("[probes.gpu]\nenabled = 1\n", ["probes.gpu.enabled", "expected a boolean"]),
    ("[health]\ntemperature_degraded_c = 500\n", ["health.temperature_degraded_c", "between 0 and 200", "500"]),
    ("[health]\nrate_window_s = 1\n", ["health.rate_window_s", "between 60", "1"]),
    ("[probes.gpu]\nbackend = 'magic'\n", ["probes.gpu.backend", "nvml, dcgm", "'magic'"]),
    ("[probes]\ngpu = 3\n", ["probes.gpu", "expected a table"]),
    ("not toml = = =\n", ["not valid TOML"]),
]


@pytest.mark.parametrize("toml,words", BAD)
def test_bad_config_exits_2_naming_the_key(tmp_path, toml, words) -> None:
    proc = run_agent(tmp_path, toml)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("mscale agent: config error:"), proc.stderr
    for w in words:
        assert w in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_listen_exits_2(tmp_path) -> None:
    proc = run_agent(tmp_path, "", listen="nowhere")
    assert proc.returncode == 2 and "agent.listen" in proc.stderr and "HOST:PORT" in proc.stderr, proc.stderr


def test_missing_config_file_exits_2(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mscale", "agent", "--config", str(tmp_path / "nope.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "cannot read config" in proc.stderr


def test_defaults_and_overrides() -> None:
    cfg = from_dict({})
    assert cfg.agent.listen == "127.0.0.1:9477" and cfg.probes.gpu.interval_s == 1.0
    assert cfg.health.temperature_degraded_c == 83.0 and cfg.health.sbe_per_hour_degraded == 100.0
    cfg = from_dict({"probes": {"gpu": {"interval_s": 2}}, "health": {"temperature_degraded_c": 85}})
    assert cfg.probes.gpu.interval_s == 2.0 and isinstance(cfg.probes.gpu.interval_s, float)
    assert cfg.health.temperature_degraded_c == 85.0


def test_error_names_key_in_process() -> None:
    with pytest.raises(ConfigError, match=r"^health\.sbe_per_hour_degraded: expected a value >= 0, got -1"):
        from_dict({"health": {"sbe_per_hour_degraded": -1}})


@pytest.mark.parametrize(
    "text,value", [("yes", True), ("ON", True), ("1", True), ("false", False), ("off", False), ("", False)]
)
def test_parse_bool(text, value) -> None:
    assert parse_bool(text) is value


def test_parse_bool_refuses_garbage() -> None:
    with pytest.raises(ValueError, match="expected a boolean"):
        parse_bool("maybe")


def test_webhook_token_from_environment(monkeypatch) -> None:
    monkeypatch.setenv("MSCALE_WEBHOOK_TOKEN", "s3cret")
    assert from_dict({}).webhook.token == "s3cret"
    assert from_dict({"webhook": {"token": "file"}}).webhook.token == "file"


def test_docs_config_table_is_generated() -> None:
    doc = (REPO / "docs" / "configuration.md").read_text()
    m = re.search(r"<!-- config-table:begin[^>]*-->\n(.*?)\n<!-- config-table:end -->", doc, re.S)
    assert m, "docs/configuration.md lacks the config-table markers"
    assert m.group(1).strip() == reference_markdown().strip(), (
        "docs/configuration.md config table is stale: paste the output of "
        "`python -c 'import mscale.config as c; print(c.reference_markdown())'` between its markers"
    )


def _keys() -> list[str]:
    return re.findall(r"^\| `([^`]+)` \|", reference_markdown(), re.M)


def test_example_config_loads_and_documents_every_key() -> None:
    path = REPO / "deploy" / "agent.toml"
    cfg = load(path)  # the example itself is valid
    assert isinstance(cfg, configmod.Config)
    text = path.read_text()
    # Every key appears, set or commented out, under its section header.
    uncommented = re.sub(r"^#\s?", "", text, flags=re.M)
    data = tomllib.loads(uncommented)
    for dotted in _keys():
        node = data
        for part in dotted.split("."):
            assert part in node, f"deploy/agent.toml does not mention {dotted}"
            node = node[part]
    from_dict(data)  # and every value shown is valid too
