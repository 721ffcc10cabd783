"""The step mark: at every step end (and after every restore) the engine keeps what a snapshot
holds besides the tensors (RNG states, data position, scheduler, grad scaler, the optimizer's
hyperparameters, the extras: a few kilobytes), so that a step whose update was dropped can be
run again from its start without a rollback (`SnapshotEngine.rewind`): its weights and optimizer
state are what they were, the rest is put back. The engine holds one `StepMark` and calls it."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, cast

from mscale.snapshot.memory import rng_state, set_rng_state, to_host
from mscale.snapshot.values import OptionalStateful, StateDict, as_dict, as_int, as_list

if TYPE_CHECKING:
    from mscale.snapshot.engine import SnapshotEngine

__all__ = ["StepMark"]

_ATOMS = (int, float, str, bool, bytes, type(None))


def _light(obj: object) -> object:
    """A copy of a state dict for the step mark, paid every step: containers rebuilt, tensors
    copied to the host, immutable leaves shared (a deep copy of each float costs more than the
    rest of the mark together); anything else deep-copied."""
    if isinstance(obj, _ATOMS):
        return obj
    if type(obj) is dict:
        return {k: _light(v) for k, v in obj.items()}
    if type(obj) is list:
        return [_light(v) for v in obj]
    if type(obj) is tuple:
        return tuple(_light(v) for v in obj)
    return to_host(obj)


class StepMark:
    """The newest step mark (None before the first)."""

    def __init__(self) -> None:
        self.objects: StateDict | None = None

    @property
    def step(self) -> int | None:
        """The step whose end the mark holds (None: none yet)."""
        return None if self.objects is None else as_int(self.objects["step"], "the mark's step")

    def take(self, engine: SnapshotEngine) -> None:
        objects: StateDict = {"step": engine.step, "rng": rng_state()}
        if engine.data is not None and getattr(engine.data, "rewinds", True):
            objects["data"] = _light(engine.data.state_dict())
        if engine.optimizer is not None:
            objects["groups"] = [
                _light({k: v for k, v in g.items() if k != "params"}) for g in engine.optimizer.param_groups
            ]
        if engine.scaler is not None:
            objects["scaler"] = _light(engine.scaler.state_dict())
        if engine.scheduler is not None:
            objects["scheduler"] = _light(engine.scheduler.state_dict())
        objects["extra"] = {name: _light(obj.state_dict()) for name, obj in engine.extra.items()}
        self.objects = objects

    def put_back(self, engine: SnapshotEngine) -> None:
        """Puts the mark's state back into the engine's live objects (not weights, not the
        optimizer's state); the caller has checked that the mark is of the step wanted."""
        mark = self.objects
        assert mark is not None
        if engine.data is not None and "data" in mark:
            engine.data.load_state_dict(copy.deepcopy(as_dict(mark["data"], "the mark's data position")))
        if engine.optimizer is not None and "groups" in mark:
            for group, saved in zip(engine.optimizer.param_groups, as_list(mark["groups"], "groups"), strict=True):
                group.update(copy.deepcopy(as_dict(saved, "a group")))
        put_back_stateful(engine, mark, "the mark's")


def put_back_stateful(engine: SnapshotEngine, objects: StateDict, whose: str) -> None:
    """The scaler, the scheduler, the extras and the RNG from `objects` (a snapshot's or a step
    mark's) into the engine's live objects, copies, not the held state itself."""
    if engine.scaler is not None:
        engine.scaler.load_state_dict(copy.deepcopy(as_dict(objects["scaler"], f"{whose} scaler state")))
    if engine.scheduler is not None:
        engine.scheduler.load_state_dict(copy.deepcopy(as_dict(objects["scheduler"], f"{whose} scheduler state")))
    extra = as_dict(objects["extra"], f"{whose} extras' state")
    for name, obj in engine.extra.items():
        state = extra.get(name)
        if state is None:  # fit.py let only a snapshot_optional extra be missing: restored as "none made"
            cast(OptionalStateful, obj).load_state_dict(None)
            continue
        obj.load_state_dict(copy.deepcopy(as_dict(state, f"{whose} state of {name!r}")))
    set_rng_state(as_dict(objects["rng"], f"{whose} RNG state"))
