"""Strict configuration: bad files stop `mscale agent` with exit 2 and a message naming the key;
the table in docs/configuration.md and the example deploy/agent.toml stay in step with the code."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mscale import options
from mscale.daemon import config as configmod
from mscale.daemon.config import ConfigError, from_dict, load, parse_bool, reference_markdown
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
    ("a = 1\n'", ["not valid TOML", "end of document, line 2"]),
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
        "`python -c 'import mscale.daemon.config as c; print(c.reference_markdown())'` between its markers"
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


# --- non-finite numbers, lines, and fuzzing (issue 16 item 8) ------------------------------


def _float_keys() -> list[str]:
    """Every float key of the config (from the dataclass types, not a hand list)."""
    import dataclasses

    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for f, tp in options.fields_of(cls):
            if isinstance(tp, type) and dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
            elif tp is float:
                out.append(f"{prefix}{f.name}")

    walk(configmod.Config, "")
    return out


def _nested(dotted: str, value: object) -> dict:
    *tables, leaf = dotted.split(".")
    data: dict = {leaf: value}
    for t in reversed(tables):
        data = {t: data}
    return data


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_every_float_key_refuses_non_finite(value) -> None:
    keys = _float_keys()
    assert "probes.gpu.interval_s" in keys and "healing.lr_cool_factor" in keys and len(keys) >= 15
    for dotted in keys:
        with pytest.raises(ConfigError, match=rf"^{re.escape(dotted)}: expected a finite number"):
            from_dict(_nested(dotted, value))


def test_error_names_the_line_in_the_keys_own_table(tmp_path) -> None:
    # interval_s appears in two tables: the message points at the one at fault
    path = tmp_path / "agent.toml"
    path.write_text("[probes.gpu]\ninterval_s = 1\n\n[probes.host]\ninterval_s = nan\n")
    with pytest.raises(ConfigError, match=r"probes\.host\.interval_s \(line 5\)"):
        load(path)
    path.write_text('[probes]\ngpu = { interval_s = "x" }\n')
    with pytest.raises(ConfigError, match=r"probes\.gpu\.interval_s \(line 2\)"):
        load(path)
    path.write_text("[healing]\n\ndistill_weight_min = 0.9\ndistill_weight_max = 0.2\n")
    with pytest.raises(ConfigError, match=r"healing\.distill_weight_min \(line 3\): expected at most"):
        load(path)


TRICKY_VALUES = [
    "nan", "+nan", "-nan", "inf", "-inf", "1e400", "-0.0", "0", "1", "-5", "1.5", "9" * 300, "0x10",
    '"x"', '"256.1.1.1:80"', '"\\u0000"', '"²"', "true", "[1, true]", "[]", '["root", -5, 1.5]', "{a = 1}",
    "1979-05-27", "07:32:00",
]  # fmt: skip


def _config_lines() -> st.SearchStrategy[list[str]]:
    keys = _keys()
    sections = sorted({k.rsplit(".", 1)[0] for k in keys if "." in k}) + ["agnet", "probes.nope"]
    leaves = sorted({k.rsplit(".", 1)[-1] for k in keys}) + ["interval", "colour"]
    header = st.sampled_from(sections).map(lambda s: f"[{s}]")
    assignment = st.tuples(st.sampled_from(leaves), st.sampled_from(TRICKY_VALUES) | st.text(max_size=8)).map(
        lambda kv: f"{kv[0]} = {kv[1]}"
    )
    return st.lists(header | assignment | st.text(max_size=20), max_size=8)


@given(lines=_config_lines(), raw=st.binary(max_size=12))
def test_fuzzed_config_is_a_config_or_a_clear_refusal(lines, raw) -> None:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "agent.toml"
        path.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass") + b"\n" + raw)
        try:
            cfg = load(path)
        except ConfigError as e:
            msg = str(e)
            assert msg.startswith(str(path)), msg
            assert "line" in msg, msg  # the line at fault (TOML's own errors say "at line N")
        else:
            assert isinstance(cfg, configmod.Config)
            for dotted in _float_keys():
                node: object = cfg
                for part in dotted.split("."):
                    node = getattr(node, part)
                assert isinstance(node, float) and node == node and abs(node) != float("inf")
