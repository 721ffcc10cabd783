"""The shapes of the untyped values the snapshot room passes around, named once (torch-free):
what a `state_dict()` returns and a `load_state_dict()` takes (torch's own type for it), and a
decoded JSON object (a manifest, an identity, a binding). Their values are checked where they
are read (manifest.py, fit.py), not by these names."""

from __future__ import annotations

from typing import Any, Protocol, TypeAlias

__all__ = ["JSONObject", "StateDict", "Stateful"]

StateDict: TypeAlias = dict[str, Any]
"""A state dict: names to tensors, numbers, strings and nested containers of them."""

JSONObject: TypeAlias = dict[str, Any]
"""A JSON object as `json.loads` gives it, or one about to be written with `json.dumps`."""


class Stateful(Protocol):
    """What the engine snapshots beside the model: a grad scaler, an LR scheduler, an extra."""

    def state_dict(self) -> StateDict: ...

    def load_state_dict(self, state_dict: StateDict, /) -> None: ...
