"""An optimizer's state keyed by parameter name, as a snapshot holds it.

torch's optimizer state_dict numbers parameters by position; a snapshot names each one by its
fully qualified name in the model instead, so the state of a parameter goes to the file of the
MPU that owns it, and a snapshot is checked against the live optimizer's groups before
anything is restored. A rollback restores in place (no allocation, the snapshot's buffers never
aliased by the optimizer); a restore from disk hands the freshly read tensors over.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from mscale.snapshot.format import SnapshotError
from mscale.snapshot.memory import to_host
from mscale.snapshot.values import StateDict, as_dict, as_list

__all__ = ["NamedOptimizer", "fits"]

Pairs = list[tuple[torch.Tensor, torch.Tensor]]


class NamedOptimizer:
    """`optimizer` (over parameters of `model`) with its state named by parameter."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.names = self._names()

    def _names(self) -> list[str]:
        """Fully qualified name of each optimizer parameter, in state_dict index order."""
        name_of = {id(p): n for n, p in self.model.named_parameters()}
        names = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in name_of:
                    raise ValueError("the optimizer holds a parameter that is not in the model")
                names.append(name_of[id(p)])
        return names

    def _refresh(self) -> None:
        # Parameter groups added after the engine was made (add_param_group) join the names.
        if len(self.names) != sum(len(g["params"]) for g in self.optimizer.param_groups):
            self.names = self._names()

    def capture(self, files: dict[str, dict[str, torch.Tensor]], file_of: Callable[[str], str]) -> StateDict:
        """Adds references to the live state tensors to `files` (parameter name -> file name by
        file_of, key "optim/<fqn>/<key>"); returns a host copy of the rest: the class, the
        groups with parameters by name, and the non-tensor state per parameter."""
        self._refresh()
        osd = self.optimizer.state_dict()
        scalars: dict[str, StateDict] = {}
        for idx, st in osd["state"].items():
            fqn = self.names[idx]
            f = file_of(fqn)
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    files[f][f"optim/{fqn}/{k}"] = v
                else:
                    scalars.setdefault(fqn, {})[k] = copy.deepcopy(v)
        groups = [
            {**{k: to_host(v) for k, v in g.items() if k != "params"}, "params": [self.names[i] for i in g["params"]]}
            for g in osd["param_groups"]
        ]
        return {"class": type(self.optimizer).__name__, "param_groups": groups, "scalars": scalars}

    def check(self, saved: StateDict | None, where: str, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Refuses a snapshot whose optimizer groups name other parameters than the live ones,
        and (given its state `tensors`, "<fqn>/<key>") one whose state does not fit (check_state)."""
        self._refresh()
        if saved is None:
            raise SnapshotError(f"{where} holds no optimizer state")
        ours = []
        i = 0
        for g in self.optimizer.param_groups:
            ours.append(self.names[i : i + len(g["params"])])
            i += len(g["params"])
        theirs = [list(as_list(as_dict(g, "a group")["params"], "its params")) for g in _groups(saved)]
        if ours != theirs:
            raise SnapshotError(f"{where}: the optimizer's parameter groups differ from the snapshot's")
        if tensors is not None:
            self.check_state(saved, where, tensors, ours)

    def check_state(
        self, saved: StateDict, where: str, tensors: dict[str, torch.Tensor], groups: list[list[str]]
    ) -> None:
        """Every state tensor fits before a byte is applied: the same keys, shapes and dtypes as
        the live optimizer's state where it holds some; for torch's own optimizers (whose state
        tensors are the shape and dtype of their parameter, 0-d ones aside) the parameter's, and
        every parameter of a group holding the same keys (none missing)."""
        what = f"{where} does not fit the optimizer"
        state: dict[str, StateDict] = {}
        for key, t in tensors.items():
            fqn, _, name = key.rpartition("/")
            state.setdefault(fqn, {})[name] = t
        for fqn, scalars in as_dict(saved.get("scalars", {}), "the optimizer's scalars").items():
            for name, v in as_dict(scalars, f"the scalars of {fqn}").items():
                state.setdefault(fqn, {})[name] = v
        if unknown := sorted(state.keys() - set(self.names)):
            raise SnapshotError(f"{what}: it holds state for {unknown[:3]}, not parameters of the optimizer")
        params = dict(zip(self.names, [p for g in self.optimizer.param_groups for p in g["params"]], strict=True))
        torch_own = type(self.optimizer).__module__.startswith("torch.optim")
        for group in groups:
            held = {fqn: state[fqn] for fqn in group if state.get(fqn)}
            every = set().union(*(s.keys() for s in held.values())) if held else set()
            for fqn in group:
                p, theirs, mine = params[fqn], state.get(fqn, {}), self.optimizer.state.get(params[fqn], {})
                if mine and mine.keys() != theirs.keys():
                    raise SnapshotError(
                        f"{what}: optim/{fqn} holds {sorted(theirs)}, the optimizer's state {sorted(mine)}"
                    )
                if torch_own and theirs and (missing := sorted(every - theirs.keys())):
                    raise SnapshotError(f"{what}: optim/{fqn} lacks {missing} (its group's other parameters hold them)")
                for name, held_value in theirs.items():
                    live = mine.get(name)
                    if isinstance(live, torch.Tensor):
                        fits(f"optim/{fqn}/{name}", held_value, live, what, "the optimizer's")
                    elif not mine and torch_own and isinstance(held_value, torch.Tensor) and held_value.dim() > 0:
                        fits(f"optim/{fqn}/{name}", held_value, p, what, "its parameter's")

    def restore(
        self,
        opt_tensors: dict[str, dict[str, torch.Tensor]],
        saved: StateDict,
        *,
        copy_pairs: Callable[[Pairs], object],
        owned: bool = False,
    ) -> None:
        """Puts the state back: opt_tensors is parameter name -> key -> tensor, saved what
        capture() returned. copy_pairs copies (dst, src) pairs; owned: the tensors are fresh
        and may become the optimizer's state without a copy."""
        opt = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        wanted: dict[str, StateDict] = {}
        scalars = as_dict(saved["scalars"], "the optimizer's scalars")
        for fqn in self.names:  # index order, as the optimizer itself would hold it
            if fqn in opt_tensors or fqn in scalars:
                wanted[fqn] = {**as_dict(scalars.get(fqn, {}), f"the scalars of {fqn}"), **opt_tensors.get(fqn, {})}
        # In place when the live state has the same structure (a rollback): no allocation, and
        # the snapshot's buffers are never aliased by the optimizer. Fresh tensors (owned, read
        # from disk) are handed over instead: copying them would only cost another pass.
        in_place = not owned and all(
            _same_layout(opt.state.get(p, {}), wanted.get(fqn, {})) for p, fqn in zip(params, self.names, strict=True)
        )
        with torch.no_grad():
            if in_place:
                pairs = []
                for p, fqn in zip(params, self.names, strict=True):
                    cur = opt.state.get(p, {})  # the same keys as wanted (checked above)
                    for k, v in wanted.get(fqn, {}).items():
                        if isinstance(v, torch.Tensor):
                            pairs.append((cur[k], v))
                        else:
                            cur[k] = copy.deepcopy(v)
                copy_pairs(pairs)
                for g, sg in zip(opt.param_groups, _groups(saved), strict=True):
                    for k, v in as_dict(sg, "a group").items():
                        if k != "params":
                            g[k] = copy.deepcopy(v) if not isinstance(v, torch.Tensor) else v.clone()
                return
        index = {fqn: i for i, fqn in enumerate(self.names)}
        # In-memory buffers are cloned (the optimizer would otherwise update them in place).
        state = {
            index[fqn]: {
                k: ((v if owned else v.clone()) if isinstance(v, torch.Tensor) else copy.deepcopy(v))
                for k, v in want.items()
            }
            for fqn, want in wanted.items()
        }
        groups = [
            {
                **copy.deepcopy({k: v for k, v in sg.items() if k != "params"}),
                "params": [index[str(n)] for n in as_list(sg["params"], "a group's params")],
            }
            for sg in (as_dict(g, "a group") for g in _groups(saved))
        ]
        opt.load_state_dict({"state": state, "param_groups": groups})


def fits(key: str, saved: object, live: torch.Tensor, what: str, whose: str) -> None:
    """Refuses (SnapshotError, naming the tensor and both) a saved tensor whose shape or dtype
    is not the live one's: loading it would cast or reshape it silently, or fail later."""
    if not isinstance(saved, torch.Tensor):
        raise SnapshotError(f"{what}: {key} is a {type(saved).__name__}, {whose} a tensor")
    if tuple(saved.shape) != tuple(live.shape) or saved.dtype != live.dtype:
        raise SnapshotError(
            f"{what}: {key} has shape {tuple(saved.shape)} and dtype {saved.dtype}, "
            f"{whose} shape {tuple(live.shape)} and dtype {live.dtype}"
        )


def _same_layout(cur: StateDict, want: StateDict) -> bool:
    """Whether the live state `cur` of a parameter can take `want` in place."""
    return cur.keys() == want.keys() and not any(
        isinstance(v, torch.Tensor) != isinstance(c := cur[k], torch.Tensor)
        or (isinstance(v, torch.Tensor) and isinstance(c, torch.Tensor) and (v.shape != c.shape or v.dtype != c.dtype))
        for k, v in want.items()
    )


def _groups(saved: StateDict) -> list[object]:
    """The parameter groups a captured optimizer state holds (each params by name)."""
    return list(as_list(saved["param_groups"], "the optimizer's param_groups"))
