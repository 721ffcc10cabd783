"""Loss spike: multiply the learning rate by `healing.lr_cool_factor` for
`healing.lr_cool_steps` steps, then restore it. Applied to each step's update inside the
window and undone right after it, so an LR scheduler keeps its own schedule."""
from __future__ import annotations

from mscale.healing.actions.base import ActionFailed, ActionSpec


def apply(fuse, d) -> str:
    if fuse.guard.optimizer is None:
        raise ActionFailed("no optimizer attached")
    fuse.start_cooling(d.step if d.step is not None else fuse.guard.current_step)
    return "applied"


ACTION = ActionSpec("lr_cool", "none", None, apply, "cool the learning rate for a window")
