"""An Alertmanager alert as the agent holds it: read and checked once, at the webhook (`parse`
takes a version 4 payload), then handed to the healing service typed (mscale.daemon.healing).

An alert carries its status, its labels (alertname among them), its start and Alertmanager's
fingerprint, and what makes its repeat the same alert (`identity`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

STATUSES = ("firing", "resolved")


class PayloadError(ValueError):
    """The payload is not an Alertmanager version 4 webhook body; the message says where."""


@dataclass(frozen=True, slots=True)
class Alert:
    """One alert of a webhook body. `labels` are Alertmanager's, `alertname` among them."""

    status: str  # firing or resolved
    labels: Mapping[str, str]
    starts_at: str = ""  # RFC 3339, as Alertmanager sent it ("" when absent)
    fingerprint: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise PayloadError(f"status: expected firing or resolved, got {self.status!r}")
        if not self.labels.get("alertname"):
            raise PayloadError("labels.alertname: missing")

    @property
    def name(self) -> str:
        return self.labels["alertname"]

    @property
    def firing(self) -> bool:
        return self.status == "firing"

    @property
    def severity(self) -> str:
        return self.labels.get("severity", "")

    @property
    def identity(self) -> tuple[str, str]:
        """What makes a repeat the same alert: (fingerprint, start); labels when no fingerprint."""
        return (self.fingerprint or json.dumps(dict(self.labels), sort_keys=True), self.starts_at)

    @classmethod
    def from_payload(cls, a: object, where: str) -> Alert:
        """One entry of a payload's `alerts`, checked field by field (PayloadError names it)."""
        if not isinstance(a, dict):
            raise PayloadError(f"{where}: expected an object")
        if a.get("status") not in STATUSES:
            raise PayloadError(f"{where}.status: expected firing or resolved, got {a.get('status')!r}")
        labels = _str_map(a.get("labels"), f"{where}.labels")
        if not labels.get("alertname"):
            raise PayloadError(f"{where}.labels.alertname: missing")
        _str_map(a.get("annotations", {}), f"{where}.annotations")
        for ts in ("startsAt", "endsAt"):
            if ts in a and not isinstance(a[ts], str):
                raise PayloadError(f"{where}.{ts}: expected an RFC 3339 time string")
        return cls(str(a["status"]), labels, a.get("startsAt", ""), str(a.get("fingerprint", "")))


def _str_map(value: Any, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise PayloadError(f"{what}: expected an object of strings")
    return value


def parse(body: Any) -> list[Alert]:
    """Validate an Alertmanager v4 payload; returns its alerts. PayloadError says why not."""
    if not isinstance(body, dict):
        raise PayloadError("body: expected a JSON object")
    if body.get("version") != "4":
        raise PayloadError(f'version: expected "4" (Alertmanager webhook payload), got {body.get("version")!r}')
    if body.get("status") not in STATUSES:
        raise PayloadError(f"status: expected firing or resolved, got {body.get('status')!r}")
    alerts = body.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError("alerts: expected a list")
    return [Alert.from_payload(a, f"alerts[{i}]") for i, a in enumerate(alerts)]
