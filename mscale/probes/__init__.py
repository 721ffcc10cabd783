"""Probe registry: one line per probe. Modules are imported only when enabled."""
from __future__ import annotations

import importlib

from mscale.probes.base import ProbeSpec

# name -> module exporting SPEC. The agent runs every enabled one; see [probes.<name>].
REGISTRY: dict[str, str] = {
    "gpu": "mscale.probes.gpu",
    "host": "mscale.probes.host",
    "ebpf": "mscale.probes.ebpf",
}


def spec(name: str) -> ProbeSpec:
    return importlib.import_module(REGISTRY[name]).SPEC
