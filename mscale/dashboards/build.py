"""Render the dashboards from their grafanalib sources. One line per dashboard module.

`python -m mscale.dashboards.build` rewrites the committed JSON (mscale/dashboards/json/);
a test re-renders and fails on a diff. `mscale dashboards export DIR` writes them for operators.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

DASHBOARDS: tuple[str, ...] = (
    "mscale.dashboards.mpu_health",
    "mscale.dashboards.gpu_node",
    "mscale.dashboards.training",
    "mscale.dashboards.healing",
)
JSON_DIR = Path(__file__).resolve().parent / "json"


def render(params: dict) -> dict[str, str]:
    """File name -> dashboard JSON text."""
    from grafanalib._gen import DashboardEncoder

    from mscale.dashboards.common import Ctx

    ctx = Ctx(params)
    out = {}
    for module in DASHBOARDS:
        mod = importlib.import_module(module)
        data = mod.build(ctx).to_json_data()
        out[f"{mod.UID}.json"] = json.dumps(data, cls=DashboardEncoder, sort_keys=True, indent=2) + "\n"
    return out


def panel_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel, rows included."""
    found = []
    for panel in dashboard.get("panels", []):
        for inner in [panel, *panel.get("panels", [])]:
            for t in inner.get("targets", []):
                if t.get("expr"):
                    found.append((inner.get("title", ""), t["expr"]))
    return found


def variable_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(variable name, the PromQL inside its label_values() query)."""
    found = []
    for var in dashboard.get("templating", {}).get("list", []):
        q = var.get("query", "")
        if var.get("type") == "query" and q.startswith("label_values("):
            found.append((var["name"], q[len("label_values(") : q.rindex(",")]))
    return found


def main() -> int:
    from mscale.rules import params as paramsmod

    JSON_DIR.mkdir(exist_ok=True)
    for name, text in render(paramsmod.load()).items():
        (JSON_DIR / name).write_text(text)
        print(f"wrote mscale/dashboards/json/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


GRAFANA_BUILTINS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "1h"}


def instantiate(expr: str, variables: dict[str, str] | None = None) -> str:
    """The PromQL Grafana would send: built-in intervals filled in, each dashboard variable
    replaced by its value (default: `.*`, the "All" value)."""
    for name, value in GRAFANA_BUILTINS.items():
        expr = expr.replace(name, value)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: (variables or {}).get(m.group(1), ".*"), expr)
