"""Run a command of `mscale` (or `-c CODE`) as the README installs the agent on a node: the
package without its extras, so torch and the other optional modules cannot be imported.

A meta-path finder refuses every module of the extras (hook, hf, dashboards, demo, kube) as a
bare virtualenv would (ModuleNotFoundError), and appends each refused name to the file named
by MSCALE_TEST_REFUSED, so a test sees an import that code caught and went on without.

    python tests/support/torchless.py agent --simulate ...
    python tests/support/torchless.py -c "import mscale.healing.actions"
"""

from __future__ import annotations

import importlib.abc
import os
import sys

# the top-level modules of pyproject's optional dependencies (what the README's agent lacks)
EXTRAS = (
    "torch",
    "numpy",
    "safetensors",
    "transformers",
    "accelerate",
    "torchdata",
    "lightning",
    "pytorch_lightning",
    "grafanalib",
    "matplotlib",
    "grpc",
    "kubernetes",
)


class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top in EXTRAS or fullname.startswith("google.protobuf"):
            log = os.environ.get("MSCALE_TEST_REFUSED")
            if log:
                with open(log, "a") as f:
                    f.write(fullname + "\n")
            raise ModuleNotFoundError(f"No module named {fullname!r} (refused: not installed with the agent)")
        return None


def main() -> None:
    for name in list(sys.modules):  # nothing of the extras may have come in before the finder
        if name.partition(".")[0] in EXTRAS:
            raise SystemExit(f"{name} was imported before the finder was installed")
    sys.meta_path.insert(0, Refuse())
    args = sys.argv[1:]
    if args[:1] == ["-c"]:
        exec(compile(args[1], "<torchless -c>", "exec"), {"__name__": "__main__"})
        return
    from mscale.cli import main as cli

    sys.argv = ["mscale", *args]
    raise SystemExit(cli())


if __name__ == "__main__":
    main()
