"""`mscale dashboards export DIR`: write the Grafana dashboards as JSON."""

from __future__ import annotations

import argparse
import sys

from mscale.textfile import write_files

HELP = "write the Grafana dashboards (JSON) generated from their grafanalib sources"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    e = sub.add_parser("export", help="write one JSON file per dashboard into DIR")
    e.add_argument("dir", metavar="DIR", help="output directory (created if missing)")
    e.add_argument("--params", metavar="FILE", help="YAML overrides merged over mscale/rules/params.yaml")


def run(args: argparse.Namespace) -> int:
    from mscale.rules import params as paramsmod

    try:
        params = paramsmod.load(args.params)
    except paramsmod.ParamsError as e:
        print(f"mscale dashboards: {e}", file=sys.stderr)
        return 2
    try:
        from mscale.dashboards import build

        files = build.render(params)
    except ModuleNotFoundError as e:  # grafanalib is the `dashboards` extra
        print(f"mscale dashboards: needs {e.name} (pip install 'megascale-omni[dashboards]')", file=sys.stderr)
        return 2
    for path in write_files(args.dir, files):
        print(path)
    return 0
