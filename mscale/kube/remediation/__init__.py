"""AGENT: node remediation hand-off. When the fuse has shown a GPU at fault (an MPU's outputs
fail on it and come clean on the standby) or the GPU probe sees a fatal Xid, the agent files it
where the cluster's remediation reads it, and undoes the filing once the GPU was reset and is
healthy again (mscale.kube.remediation.verdicts decides; .service files).

Filers, one module each exporting `SPEC` (mscale.kube.remediation.base.FilerSpec), registered
below, one line per filer; each declares its config table [remediation.<name>] and whether it
is on by default. Adding one: a module, a line, a test.
"""

from __future__ import annotations

import importlib

from mscale.kube.remediation.base import FilerSpec

# name -> module exporting SPEC, in filing order
REGISTRY: dict[str, str] = {
    "nodecondition": "mscale.kube.remediation.nodecondition",
    "externalfault": "mscale.kube.remediation.externalfault",
    "command": "mscale.kube.remediation.command",
}


def spec(name: str) -> FilerSpec:
    return importlib.import_module(REGISTRY[name]).SPEC
