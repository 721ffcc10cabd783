"""AGENT: the probes (GPU over NVML or dcgm-exporter, eBPF on the CUDA driver, host), one
module each, registered below, one line per probe. A probe's module declares its config
section and default on/off in its `SPEC` (mscale.probes.base.ProbeSpec); mscale.daemon.config
imports every registered module to assemble [probes.<name>], so a module imports optional
dependencies (BCC, a driver) only inside its factory, which runs only when it is enabled.

Adding a probe: one module exporting `SPEC`, one line below, one fixture, one test file.

May import: findings, options (the config machinery), textfile. Never imports daemon or torch.
"""

from __future__ import annotations

import importlib

from mscale.probes.base import ProbeSpec

# name -> module exporting SPEC. The agent runs every enabled one; its keys are [probes.<name>].
REGISTRY: dict[str, str] = {
    "gpu": "mscale.probes.gpu",
    "host": "mscale.probes.host",
    "ebpf": "mscale.probes.ebpf",
}


def spec(name: str) -> ProbeSpec:
    return importlib.import_module(REGISTRY[name]).SPEC
