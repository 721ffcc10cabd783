"""Fault timelines for the simulated GPUs: a small YAML file, strictly checked.

    gpus: 8                 # default 8
    model: h100             # h100 | h200 (default h100)
    events:
      - at: 2s              # after start: "2s", "500ms", "1m", "1h" or a number of seconds
        gpu: 3
        fault: xid          # see FAULTS
        code: 79
      - {at: 5s, gpu: 1, fault: temperature, celsius: 88, ramp: 3s}
      - {at: 6s, gpu: 2, fault: xid, code: 154, recovery_action: 2}   # NVML's values 0..4

A malformed file raises TimelineError naming the line at fault (from YAML's node marks).
`event_from_dict` checks one event the same way (the chaos API injects through it).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mscale.textfile import read_text

MAX_GPUS = 64
MODELS = ("h100", "h200")
NVLINKS_PER_GPU = 18  # H100/H200 SXM

# fault -> {parameter: (required, parser)}; parsers raise ValueError with what was expected.
_Parser = Callable[[Any], Any]


def _int_in(lo: int, hi: int) -> _Parser:
    def parse(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ValueError(f"expected an integer {lo}..{hi}, got {_short(v)}")
        return v

    return parse


def _number_in(lo: float, hi: float, *, above: bool = False) -> _Parser:
    def parse(v: Any) -> float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and (v > lo if above else v >= lo) and v <= hi
        if not ok:
            raise ValueError(f"expected a number {'above' if above else 'from'} {lo:g} to {hi:g}, got {_short(v)}")
        return float(v)

    return parse


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^\s*([0-9]{1,12}(?:\.[0-9]{1,9})?)\s*(ms|s|m|h)?\s*$")
MAX_DURATION_S = 366 * 86400.0  # a timeline is a test run: a year bounds a typo, not a use


def parse_duration(v: Any) -> float:
    """'2s', '500ms', '1m', '1h', or a plain number of seconds; finite, 0..MAX_DURATION_S."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        # Compared before any float(): a 400-digit integer would overflow it.
        if not (0 <= v <= MAX_DURATION_S) or (isinstance(v, float) and not math.isfinite(v)):
            raise ValueError(f"expected a duration from 0 to {MAX_DURATION_S:g}s, got {_short(v)}")
        return float(v)
    m = _DURATION.match(v) if isinstance(v, str) else None
    if not m:
        raise ValueError(f"expected a duration like 2s, 500ms or 1m, got {_short(v)}")
    seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if seconds > MAX_DURATION_S:
        raise ValueError(f"expected a duration from 0 to {MAX_DURATION_S:g}s, got {_short(v)}")
    return seconds


def _short(v: Any, limit: int = 60) -> str:
    """repr(v), cut to `limit` characters: messages name the value, not a 300-digit one in full."""
    try:
        r = repr(v)
    except ValueError:  # an int too long for repr (over 4300 digits)
        return f"an integer of about {int(v.bit_length() * 0.30103)} digits"
    return r if len(r) <= limit else f"{r[: limit - 3]}..."


FAULTS: dict[str, dict[str, tuple[bool, _Parser]]] = {
    # recovery_action (Xid 154): what the driver now requires, NVML's values 0..4
    "xid": {"code": (True, _int_in(1, 65535)), "recovery_action": (False, _int_in(0, 4))},
    "ecc_dbe": {"count": (False, _int_in(1, 1_000_000))},
    "ecc_sbe_storm": {"per_hour": (True, _number_in(0, 1e9, above=True))},
    "temperature": {"celsius": (True, _number_in(0, 150)), "ramp": (False, parse_duration)},
    "nvlink_down": {"link": (True, _int_in(0, NVLINKS_PER_GPU - 1))},
    "pcie_replay_storm": {"per_min": (True, _number_in(0, 1e9, above=True))},
    "gpu_lost": {},
    "recover": {},
}
_COMMON = ("at", "gpu", "fault")


class TimelineError(ValueError):
    """A malformed timeline; the message names the file, line and field at fault."""


@dataclass(frozen=True)
class FaultEvent:
    at_s: float
    gpu: int
    fault: str
    code: int | None = None  # xid
    recovery_action: int | None = None  # xid 154
    count: int = 1  # ecc_dbe
    per_hour: float | None = None  # ecc_sbe_storm
    celsius: float | None = None  # temperature
    ramp_s: float = 0.0  # temperature
    link: int | None = None  # nvlink_down
    per_min: float | None = None  # pcie_replay_storm
    line: int | None = None  # where it came from, for messages

    def describe(self) -> str:
        extra = {
            "xid": f" {self.code}",
            "temperature": f" {self.celsius:g} C" if self.celsius is not None else "",
            "nvlink_down": f" link {self.link}",
            "ecc_sbe_storm": f" {self.per_hour:g}/h" if self.per_hour else "",
            "pcie_replay_storm": f" {self.per_min:g}/min" if self.per_min else "",
        }.get(self.fault, "")
        return f"{self.fault}{extra} on GPU {self.gpu}"


@dataclass(frozen=True)
class Timeline:
    gpus: int = 8
    model: str = "h100"
    events: tuple[FaultEvent, ...] = ()
    source: str = "<timeline>"


_PARAM_FIELD = {
    "code": "code",
    "recovery_action": "recovery_action",
    "count": "count",
    "per_hour": "per_hour",
    "celsius": "celsius",
    "ramp": "ramp_s",
    "link": "link",
    "per_min": "per_min",
}


def _event(data: dict, gpus: int, where: Callable[[str], str], line: int | None) -> FaultEvent:
    fault = data.get("fault")
    if fault is None:
        raise TimelineError(f"{where('fault')}: missing (one of {', '.join(FAULTS)})")
    if not isinstance(fault, str) or fault not in FAULTS:
        raise TimelineError(f"{where('fault')}: expected one of {', '.join(FAULTS)}, got {_short(fault)}")
    params = FAULTS[fault]
    for key in data:
        if not isinstance(key, str) or (key not in _COMMON and key not in params):
            allowed = ", ".join(list(_COMMON) + list(params))
            raise TimelineError(f"{where(str(key))}: unknown key for fault {fault} (allowed: {allowed})")
    kwargs: dict[str, Any] = {"fault": fault, "line": line}
    try:
        kwargs["at_s"] = parse_duration(data.get("at", 0))
    except ValueError as e:
        raise TimelineError(f"{where('at')}: {e}") from None
    if "gpu" not in data:
        raise TimelineError(f"{where('gpu')}: missing (a GPU index 0..{gpus - 1})")
    try:
        kwargs["gpu"] = _int_in(0, gpus - 1)(data["gpu"])
    except ValueError as e:
        raise TimelineError(f"{where('gpu')}: {e}") from None
    for key, (required, parse) in params.items():
        if key not in data:
            if required:
                raise TimelineError(f"{where(key)}: missing (fault {fault} needs {key})")
            continue
        try:
            kwargs[_PARAM_FIELD[key]] = parse(data[key])
        except ValueError as e:
            raise TimelineError(f"{where(key)}: {e}") from None
    if kwargs.get("recovery_action") is not None and kwargs.get("code") != 154:
        raise TimelineError(
            f"{where('recovery_action')}: only Xid 154 names a recovery action, got code {kwargs['code']}"
        )
    return FaultEvent(**kwargs)


def event_from_dict(data: Any, *, gpus: int, at_s: float | None = None) -> FaultEvent:
    """Check one event given as a dict (e.g. from the chaos API). `at` defaults to now (0)."""
    if not isinstance(data, dict):
        raise TimelineError(f"event: expected a mapping, got {type(data).__name__}")
    ev = _event(data, gpus, lambda key: f"event.{key}", None)
    return ev if at_s is None else dataclasses.replace(ev, at_s=at_s)


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def parse_timeline(text: str, source: str = "<timeline>") -> Timeline:
    loader: yaml.SafeLoader | None = None
    try:
        loader = yaml.SafeLoader(text)  # checks the characters already: inside the try
        root = loader.get_single_node()
        if root is None:
            return Timeline(source=source)
        gpus, model, events = _Nodes(loader, source).timeline(root)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line = f" line {mark.line + 1}" if mark else ""
        raise TimelineError(f"{source}{line}: not valid YAML: {e.problem or e.context}") from None
    except yaml.reader.ReaderError as e:  # a character YAML does not allow (a NUL, a control)
        at = text.count("\n", 0, e.position) + 1
        raise TimelineError(f"{source} line {at}: not valid YAML: {e.reason} (#x{e.character:04x})") from None
    except yaml.YAMLError as e:
        raise TimelineError(f"{source}: not valid YAML: {e}") from None
    except RecursionError:
        raise TimelineError(f"{source}: not valid YAML: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()
    events.sort(key=lambda e: e.at_s)  # stable: same-time events keep file order
    return Timeline(gpus=gpus, model=model, events=tuple(events), source=source)


class _Nodes:
    """A timeline's YAML nodes read into its values, each error naming the line at fault."""

    def __init__(self, loader: yaml.SafeLoader, source: str) -> None:
        self.loader, self.source = loader, source

    def value(self, node: yaml.Node, what: str) -> Any:
        try:
            return self.loader.construct_object(node, deep=True)
        except (ValueError, TypeError, OverflowError) as e:  # e.g. `!!int x`, a date 2001-13-45
            raise TimelineError(f"{self.source} line {_line(node)}: {what}: not a valid value ({e})") from None

    def key(self, node: yaml.Node, what: str) -> str:
        k = self.value(node, what) if isinstance(node, yaml.ScalarNode) else None
        if not isinstance(k, str):
            raise TimelineError(f"{self.source} line {_line(node)}: {what}: keys must be plain names")
        return k

    def timeline(self, root: yaml.Node) -> tuple[int, str, list[FaultEvent]]:
        """(gpus, model, events) from the document's root mapping."""
        source = self.source
        if not isinstance(root, yaml.MappingNode):
            raise TimelineError(f"{source} line {_line(root)}: expected a mapping with gpus and events")
        top = {self.key(k, "key"): (k, v) for k, v in root.value}
        for name, (knode, _) in top.items():
            if name not in ("gpus", "model", "events"):
                raise TimelineError(
                    f"{source} line {_line(knode)}: {_short(name)}: unknown key (known: gpus, model, events)"
                )
        gpus = 8
        if "gpus" in top:
            node = top["gpus"][1]
            try:
                gpus = _int_in(1, MAX_GPUS)(self.value(node, "gpus"))
            except ValueError as e:
                raise TimelineError(f"{source} line {_line(node)}: gpus: {e}") from None
        model = "h100"
        if "model" in top:
            node = top["model"][1]
            model = self.value(node, "model")
            if not isinstance(model, str) or model not in MODELS:
                raise TimelineError(
                    f"{source} line {_line(node)}: model: expected one of {', '.join(MODELS)}, got {_short(model)}"
                )
        return gpus, model, self.events(top["events"][1], gpus) if "events" in top else []

    def events(self, node: yaml.Node, gpus: int) -> list[FaultEvent]:
        if isinstance(node, yaml.ScalarNode) and self.value(node, "events") is None:
            return []
        if not isinstance(node, yaml.SequenceNode):
            raise TimelineError(f"{self.source} line {_line(node)}: events: expected a list of events")
        return [self.event(i, ev, gpus) for i, ev in enumerate(node.value)]

    def event(self, i: int, ev: yaml.Node, gpus: int) -> FaultEvent:
        if not isinstance(ev, yaml.MappingNode):
            raise TimelineError(
                f"{self.source} line {_line(ev)}: events[{i}]: expected a mapping (at, gpu, fault, ...)"
            )
        fields = {}
        lines = {}
        for k, v in ev.value:
            name = self.key(k, f"events[{i}]")
            fields[name] = self.value(v, f"events[{i}].{name}")
            lines[name] = _line(v)

        def where(name: str) -> str:
            return f"{self.source} line {lines.get(name, _line(ev))}: events[{i}].{name}"

        return _event(fields, gpus, where, _line(ev))


def load_timeline(path: str | Path) -> Timeline:
    return parse_timeline(read_text(path, TimelineError, "the timeline"), str(Path(path)))
