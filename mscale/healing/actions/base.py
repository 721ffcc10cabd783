"""What a healing action is. One action per module in this folder, listed in __init__.py.

`apply(fuse, decision)` runs inside the training process (the fuse plugin, mscale.hook.fuse)
and returns the result label ("applied", "noop", "failed: why" is raised as ActionFailed).
The agent only needs the metadata, so action modules import torch inside their functions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from mscale.healing.fsm import Level

if TYPE_CHECKING:
    from mscale.healing.engine import Decision


class ActionFailed(RuntimeError):
    """The action could not be carried out; the message says why (it becomes an event)."""


@dataclass(frozen=True)
class ActionSpec:
    name: str
    level: str  # metric label: L1, L2, L3, or none for the non-fuse actions
    moves_to: Level | None  # fuse state of the MPU after it succeeds
    apply: Callable[[Any, "Decision"], str]
    help: str = ""
