"""The `mscale` command. One line per subcommand; each module has HELP, add_arguments, run."""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, str] = {
    "agent": "mscale.daemon.main",
    "demo": "mscale.demo.cli",
    "status": "mscale.daemon.status_cli",
    "chaos": "mscale.sim.chaos_cli",
    "rules": "mscale.rules.cli",
    "dashboards": "mscale.dashboards.cli",
    "snapshot": "mscale.snapshot.cli",
    "contract": "mscale.daemon.contract.cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mscale", description="MegaScale-Omni: observability and self-healing for multimodal training"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_path in COMMANDS.items():
        module = importlib.import_module(module_path)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
