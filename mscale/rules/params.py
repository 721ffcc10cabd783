"""The parameter file (params.yaml) and operators' overrides merged over it.

An override may only change keys the shipped file has (a typo would otherwise be silently
ignored), and must keep each value's type; `ParamsError` names the key at fault.
"""

from __future__ import annotations

import copy
import re
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

SEVERITIES = {"critical": "P0", "warning": "P1", "info": "P2"}
_DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")


class ParamsError(ValueError):
    """An override is wrong; the message names the key."""


def shipped() -> dict[str, Any]:
    text = resources.files("mscale.rules").joinpath("params.yaml").read_text()
    return yaml.safe_load(text)


def load(override: str | Path | None = None) -> dict[str, Any]:
    params = shipped()
    if override:
        try:
            extra = yaml.safe_load(Path(override).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ParamsError(f"{override}: {e}") from None
        if not isinstance(extra, dict):
            raise ParamsError(f"{override}: expected a mapping at the top level")
        params = merge(params, extra)
    validate(params)
    return params


def merge(base: dict, extra: dict, path: str = "") -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        where = f"{path}{key}"
        if key not in base:
            raise ParamsError(f"{where}: unknown key (known: {', '.join(map(str, base))})")
        old = base[key]
        if isinstance(old, dict):
            if not isinstance(value, dict):
                raise ParamsError(f"{where}: expected a mapping, got {value!r}")
            out[key] = merge(old, value, where + ".")
        elif isinstance(old, bool) != isinstance(value, bool) or not isinstance(value, _kind(old)):
            raise ParamsError(f"{where}: expected {_kind_name(old)}, got {value!r}")
        else:
            out[key] = value
    return out


def _kind(value: Any) -> type | tuple[type, ...]:
    if isinstance(value, bool):
        return bool
    if isinstance(value, (int, float)):
        return (int, float)
    return type(value)


def _kind_name(value: Any) -> str:
    kind = _kind(value)
    return "number" if isinstance(kind, tuple) else kind.__name__


def validate(params: dict) -> None:
    for name, a in params["alerts"].items():
        if a.get("severity") not in SEVERITIES:
            raise ParamsError(
                f"alerts.{name}.severity: expected one of {', '.join(SEVERITIES)}, got {a.get('severity')!r}"
            )
        if not _DURATION.match(str(a.get("for", ""))):
            raise ParamsError(f"alerts.{name}.for: expected a Prometheus duration like 1m, got {a.get('for')!r}")
    for key, value in params["windows"].items():
        if not _DURATION.match(str(value)):
            raise ParamsError(f"windows.{key}: expected a Prometheus duration like 5m, got {value!r}")
    routes = params["alertmanager"]["routes"]
    if set(routes) != set(SEVERITIES):
        raise ParamsError(f"alertmanager.routes: expected one route per severity ({', '.join(SEVERITIES)})")
