"""Dashboards: generated from grafanalib sources and params.yaml, committed JSON in step,
every PromQL query parses (checked by promtool through a rule file)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

from mscale.dashboards import build
from mscale.rules import params as paramsmod
from support import REPO, require_tool

VARIABLES = {"datasource", "node", "job_id", "gpu"}


def committed() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(build.JSON_DIR.glob("*.json"))}


def test_committed_json_is_what_the_sources_generate():
    fresh = build.render(paramsmod.load())
    assert sorted(fresh) == sorted(committed()), "run `make render`"
    for name, text in fresh.items():
        assert (build.JSON_DIR / name).read_text() == text, f"{name} is stale: run `make render`"


def test_the_four_dashboards_and_their_variables():
    dashes = committed()
    titles = {d["title"] for d in dashes.values()}
    assert {
        "mscale / MPU health",
        "mscale / GPU node",
        "mscale / Training stability",
        "mscale / Healing and snapshots",
    } <= titles
    assert len({d["uid"] for d in dashes.values()}) == len(dashes)
    for name, d in dashes.items():
        names = {v["name"] for v in d["templating"]["list"]}
        assert {"datasource", "node"} <= names, name
        used = {m for _, e in build.panel_exprs(d) for m in re.findall(r"\$\{?(\w+)", e)}
        used -= {b.strip("$") for b in build.GRAFANA_BUILTINS}
        assert used <= names, f"{name}: panels use undefined variables {used - names}"
    assert "gpu" in {v["name"] for v in dashes["mscale-gpu-node.json"]["templating"]["list"]}
    assert "job_id" in {v["name"] for v in dashes["mscale-training.json"]["templating"]["list"]}


def test_panels_have_queries_and_do_not_overlap():
    for name, d in committed().items():
        cells: set[tuple[int, int]] = set()
        for p in d["panels"]:
            if p["type"] != "row":
                assert p.get("targets") and all(t["expr"] for t in p["targets"]), f"{name}: {p['title']} has no query"
            pos = p["gridPos"]
            assert pos["x"] + pos["w"] <= 24
            mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
            assert not cells & mine, f"{name}: {p['title']} overlaps another panel"
            cells |= mine


def test_every_query_parses(tmp_path: Path):
    """promtool parses each query as a recording rule's expression."""
    promtool = require_tool("promtool")
    rules = []
    for name, d in committed().items():
        queries = build.panel_exprs(d) + build.variable_exprs(d)
        assert queries
        for i, (_title, expr) in enumerate(queries):
            rules.append({"record": f"check:{Path(name).stem.replace('-', '_')}:{i}", "expr": build.instantiate(expr)})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules)} rules found" in out.stdout


def test_a_broken_query_is_caught(tmp_path: Path):
    """The parse check above can fail: promtool refuses a malformed query."""
    promtool = require_tool("promtool")
    path = tmp_path / "bad.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "groups": [
                    {
                        "name": "g",
                        "rules": [
                            {
                                "record": "check:bad",
                                "expr": build.instantiate(
                                    'rate(mscale_gpu_power_watts{node=~"$node"}[$__rate_interval]'
                                ),
                            }
                        ],
                    }
                ]
            }
        )
    )
    assert subprocess.run([promtool, "check", "rules", str(path)], capture_output=True).returncode != 0


def test_thresholds_come_from_the_parameter_file(tmp_path: Path):
    override = tmp_path / "mine.yaml"
    override.write_text("alerts:\n  MscaleGpuTemperatureHigh: {celsius: 91}\n  MscaleMpuHealthLow: {score: 45}\n")
    fresh = {n: json.loads(t) for n, t in build.render(paramsmod.load(override)).items()}

    def steps(dash: str, title: str) -> list:
        panel = next(p for p in fresh[dash]["panels"] if p["title"] == title)
        return [s["value"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]

    assert 91 in steps("mscale-gpu-node.json", "Temperature")
    assert 45 in steps("mscale-mpu-health.json", "Health score per MPU")
    assert any("< 45" in e for _, e in build.panel_exprs(fresh["mscale-mpu-health.json"]))


def test_cli_export(tmp_path: Path):
    out = tmp_path / "dash"
    done = subprocess.run(
        [sys.executable, "-m", "mscale", "dashboards", "export", str(out)], capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    assert {p.name: p.read_text() for p in out.iterdir()} == {
        p.name: p.read_text() for p in build.JSON_DIR.glob("*.json")
    }
    bad = tmp_path / "bad.yaml"
    bad.write_text("dashboards: {refresh: [1]}\n")
    refused = subprocess.run(
        [sys.executable, "-m", "mscale", "dashboards", "export", str(tmp_path / "no"), "--params", str(bad)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert refused.returncode == 2 and "dashboards.refresh" in refused.stderr
    assert not (tmp_path / "no").exists()
