"""`mscale rules export DIR`: write the Prometheus rule files and the Alertmanager example."""

from __future__ import annotations

import argparse
import sys

from mscale.textfile import write_files

HELP = "write the Prometheus alert/recording rules and the Alertmanager example"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    e = sub.add_parser("export", help="write mscale-alerts.yml, mscale-recording.yml and alertmanager.yml into DIR")
    e.add_argument("dir", metavar="DIR", help="output directory (created if missing)")
    e.add_argument("--params", metavar="FILE", help="YAML overrides merged over mscale/rules/params.yaml")
    e.add_argument(
        "--agent-url", metavar="URL", help="the agent's base URL for the healing webhook (e.g. http://node-a:9477)"
    )
    e.add_argument("--token-file", metavar="PATH", help="file Alertmanager reads the webhook bearer token from")


def run(args: argparse.Namespace) -> int:
    from mscale.rules import params as paramsmod
    from mscale.rules import render

    try:
        params = paramsmod.load(args.params)
        files = render.render_rules(params)
        files[render.ALERTMANAGER_FILE] = render.render_alertmanager(
            params, agent_url=args.agent_url, token_file=args.token_file
        )
    except (paramsmod.ParamsError, render.RenderError) as e:
        print(f"mscale rules: {e}", file=sys.stderr)
        return 2
    for path in write_files(args.dir, files):
        print(path)
    return 0
