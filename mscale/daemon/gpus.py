"""The agent's GPUs as the job state reads them: the GPU probe's latest samples by index, and
what a GPU index label may be (mscale.daemon.link_labels, mscale.daemon.standby)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from mscale.healing.target import gpu_label, gpu_of


def gpu_index(v: object) -> str:
    """`v` as a GPU index label ("0".."4095", no sign, no leading zero, ASCII digits only), or ""
    when it is not one: "²".isdigit() is true, "007" is another string than "7" (the rule is
    mscale.healing.target.gpu_of's, the one place a label becomes an index)."""
    return gpu_label(gpu_of(v))


class GpuSample(Protocol):
    """What the health score reads of a GPU's sample (mscale.probes.gpu_sample.GpuSample; the
    probe room imports the agent's state, so its type is named here by shape, not imported)."""

    @property
    def index(self) -> int: ...
    @property
    def uuid(self) -> str: ...
    @property
    def health(self) -> str: ...
    @property
    def memory_used_bytes(self) -> int | None: ...
    @property
    def memory_total_bytes(self) -> int | None: ...


class _Published(Protocol):
    @property
    def snapshots(self) -> Mapping[str, object]: ...


def gpus_by_index(state: _Published) -> dict[int, GpuSample]:
    """The latest GPU samples by index, from the GPU probe's snapshot (empty without one)."""
    snap = state.snapshots.get("gpu")
    return {g.index: g for g in getattr(snap, "gpus", ())} if snap is not None else {}
