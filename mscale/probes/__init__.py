"""AGENT: the probes (GPU over NVML or dcgm-exporter, eBPF on the CUDA driver, host), one
module each, registered below, one line per probe; a module is imported only when enabled.

May import: findings, config, textfile. Never imports daemon or torch.
"""
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
