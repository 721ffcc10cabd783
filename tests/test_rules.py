"""The Prometheus rules: rendered from params.yaml, valid for promtool, every alert unit-tested."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mscale.rules import params as paramsmod
from mscale.rules import render
from mscale.rules.alerts import ALERTS
from support import REPO, require_tool

RULES_DIR = REPO / "mscale" / "rules"
CASES_DIR = REPO / "tests" / "rules"
RULE_FILES = [RULES_DIR / render.ALERTS_FILE, RULES_DIR / render.RECORDING_FILE]


def rule_alerts() -> dict[str, dict]:
    doc = yaml.safe_load((RULES_DIR / render.ALERTS_FILE).read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"]}


def test_committed_files_are_what_params_render():
    """Edit params.yaml or alerts.py without re-rendering and this fails
    (fix: make render)."""
    stale = [
        str(p.relative_to(REPO))
        for p, text in render.committed_files(paramsmod.load()).items()
        if not p.exists() or p.read_text() != text
    ]
    assert not stale, f"out of date, run `make render`: {stale}"


def test_alert_pages_are_among_the_rendered_files():
    """docs/alerts.md and docs/runbooks.md are rendered, so the diff check above covers them."""
    files = render.committed_files(paramsmod.load())
    assert {REPO / "docs" / "alerts.md", REPO / "docs" / "runbooks.md"} <= set(files)


def test_promtool_check_rules():
    promtool = require_tool("promtool")
    out = subprocess.run([promtool, "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in out.stdout


def test_promtool_unit_tests_pass():
    promtool = require_tool("promtool")
    files = sorted(p.name for p in CASES_DIR.glob("*.yml"))
    assert files
    out = subprocess.run([promtool, "test", "rules", *files], cwd=CASES_DIR, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_a_firing_and_a_silent_case():
    firing: dict[str, set] = {}
    silent: set[str] = set()
    for path in CASES_DIR.glob("*.yml"):
        for t in yaml.safe_load(path.read_text())["tests"]:
            for case in t.get("alert_rule_test", []):
                if case.get("exp_alerts"):
                    firing.setdefault(case["alertname"], set()).update(
                        a["exp_labels"].get("severity") for a in case["exp_alerts"]
                    )
                else:
                    silent.add(case["alertname"])
    names = set(rule_alerts())
    assert names - set(firing) == set(), "alerts with no firing case"
    assert names - silent == set(), "alerts with no silent case"
    # the firing cases expect the severity the rules give
    for name, rule in rule_alerts().items():
        assert firing[name] == {rule["labels"]["severity"]}, name


def test_alerts_have_severity_annotations_and_a_runbook_in_the_docs():
    runbooks = (REPO / "docs" / "runbooks.md").read_text()
    headings = {render.anchor(line[3:].strip()) for line in runbooks.splitlines() if line.startswith("## ")}
    assert paramsmod.load()["runbook_url"].endswith("/docs/runbooks.md")
    for name, rule in rule_alerts().items():
        assert rule["labels"]["severity"] in paramsmod.SEVERITIES, name
        assert rule["labels"]["priority"] == paramsmod.SEVERITIES[rule["labels"]["severity"]]
        assert {"summary", "description", "runbook_url"} <= set(rule["annotations"]), name
        url = rule["annotations"]["runbook_url"]
        assert url.startswith(paramsmod.load()["runbook_url"] + "#"), url
        assert url.rsplit("#", 1)[1] in headings, f"{name}: no runbook heading for {url}"
    assert {"critical", "warning", "info"} == {r["labels"]["severity"] for r in rule_alerts().values()}


def test_params_override_changes_rules_and_bad_override_is_refused(tmp_path: Path):
    good = tmp_path / "good.yaml"
    good.write_text(
        "alerts:\n  MscaleGpuTemperatureHigh: {celsius: 90, for: 3m}\nselectors: {agent: 'job=\"gpu-agents\"'}\n"
    )
    text = render.render_rules(paramsmod.load(good))[render.ALERTS_FILE]
    assert 'mscale_gpu_temperature_celsius{job="gpu-agents"} >= 90' in text
    assert "for: 3m" in text
    for body, word in [
        ("alerts: {MscaleGpuTemperatureHigh: {celcius: 90}}", "celcius"),
        ("alerts: {MscaleGpuTemperatureHigh: {celsius: hot}}", "celsius"),
        ("alerts: {MscaleGpuLost: {severity: page}}", "severity"),
        ("alerts: {MscaleGpuLost: {for: soon}}", "for"),
        ("- a list", "mapping"),
    ]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(body)
        with pytest.raises(paramsmod.ParamsError, match=word):
            paramsmod.load(bad)


def test_cli_export_writes_valid_files_and_refuses_bad_params(tmp_path: Path):
    promtool = require_tool("promtool")
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "mscale",
        "rules",
        "export",
        str(out),
        "--agent-url",
        "http://10.0.0.7:9477",
        "--token-file",
        "/run/secrets/token",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [render.ALERTS_FILE, render.RECORDING_FILE, render.ALERTMANAGER_FILE]
    )
    check = subprocess.run(
        [promtool, "check", "rules", str(out / render.ALERTS_FILE), str(out / render.RECORDING_FILE)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    am = yaml.safe_load((out / render.ALERTMANAGER_FILE).read_text())
    hooks = [w for r in am["receivers"] for w in r["webhook_configs"]]
    assert {w["url"] for w in hooks} == {"http://10.0.0.7:9477/api/v1/alerts"}
    assert {w["http_config"]["authorization"]["credentials_file"] for w in hooks} == {"/run/secrets/token"}

    bad = tmp_path / "bad.yaml"
    bad.write_text("alerts: {NoSuchAlert: {severity: info}}\n")
    refused = subprocess.run(
        [sys.executable, "-m", "mscale", "rules", "export", str(tmp_path / "no"), "--params", str(bad)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert refused.returncode == 2
    assert "NoSuchAlert" in refused.stderr
    assert not (tmp_path / "no").exists()


def test_rules_are_package_data():
    """The rule files ship inside the package (pyproject package-data globs *.yml)."""
    from importlib import resources

    for name in (render.ALERTS_FILE, render.RECORDING_FILE, render.ALERTMANAGER_FILE, "params.yaml"):
        assert resources.files("mscale.rules").joinpath(name).is_file(), name


def test_fatal_xids_match_the_agents_xid_table():
    """The alert's fatal Xid codes are the ones the agent's health model treats as fatal."""
    import csv

    table = REPO / "mscale" / "probes" / "xid_table.csv"
    rows = csv.reader(line for line in table.read_text().splitlines() if line.strip() and not line.startswith("#"))
    fatal = {int(code) for code, cls, *_ in rows if cls.strip() == "fatal"}
    assert set(paramsmod.load()["alerts"]["MscaleGpuFatalXid"]["xids"]) == fatal


def test_example_prometheus_config_is_valid_and_labels_the_node():
    promtool = require_tool("promtool")
    path = REPO / "deploy" / "prometheus.yml"
    out = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    cfg = yaml.safe_load(path.read_text())
    agent_sel = paramsmod.load()["selectors"]["agent"]  # job="mscale-agent"
    for job in cfg["scrape_configs"]:
        assert any(r.get("target_label") == "node" for r in job.get("relabel_configs", [])), job["job_name"]
    assert f'job="{next(j["job_name"] for j in cfg["scrape_configs"] if "agent" in j["job_name"])}"' == agent_sel
