"""The shapes of the opaque values the snapshot room passes around, named once (torch-free):
what a `state_dict()` returns and a `load_state_dict()` takes, and a decoded JSON object (an
identity, a binding, a header). Their values are `object`: a reader narrows what it takes out
of them with the checks below (or its own `isinstance`), so a value of another shape is a
TypeError naming it, never an unchecked attribute access."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, SupportsFloat, SupportsInt, TypeAlias

__all__ = ["JSONObject", "OptionalStateful", "StateDict", "Stateful", "as_dict", "as_float", "as_int", "as_list"]

StateDict: TypeAlias = dict[str, object]
"""A state dict: names to tensors, numbers, strings and nested containers of them."""

JSONObject: TypeAlias = dict[str, object]
"""A JSON object as `json.loads` gives it, or one about to be written with `json.dumps`."""


class Stateful(Protocol):
    """What the engine snapshots beside the model: a grad scaler, an LR scheduler, an extra."""

    def state_dict(self) -> StateDict: ...

    def load_state_dict(self, state_dict: StateDict, /) -> None: ...


class OptionalStateful(Protocol):
    """An extra marked `snapshot_optional`: a snapshot made before it existed holds no state
    of it, and restoring that snapshot hands it None ("none made")."""

    def load_state_dict(self, state_dict: StateDict | None, /) -> None: ...


def as_int(value: object, what: str) -> int:
    """`int(value)` for a number (a 0-d tensor too) or a numeric string; TypeError naming `what`
    for anything else."""
    if isinstance(value, SupportsInt):
        return int(value)
    if isinstance(value, str | bytes):
        return int(value)
    raise TypeError(f"{what} must be a number, not {type(value).__name__}")


def as_float(value: object, what: str) -> float:
    """`float(value)` for a number or a numeric string; TypeError naming `what` otherwise."""
    if isinstance(value, SupportsFloat):
        return float(value)
    if isinstance(value, str | bytes):
        return float(value)
    raise TypeError(f"{what} must be a number, not {type(value).__name__}")


def as_dict(value: object, what: str) -> dict[str, object]:
    """`value` as the dict it is (not a copy); TypeError naming `what` for anything else."""
    if isinstance(value, dict):
        return value
    raise TypeError(f"{what} must be a dict, not {type(value).__name__}")


def as_list(value: object, what: str) -> Sequence[object]:
    """`value` as the list or tuple it is (not a copy); TypeError naming `what` otherwise."""
    if isinstance(value, list | tuple):
        return value
    raise TypeError(f"{what} must be a list, not {type(value).__name__}")
