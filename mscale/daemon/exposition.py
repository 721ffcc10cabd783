"""The Prometheus text format (0.0.4) of the /metrics page, written for the page's size.

prometheus_client's `generate_latest` validates and escapes every label name and metric name of
every sample with regular expressions: at the socket's MPU-state caps (25,000 series) that was
80% of a render, 2.9 of 3.6 s under a profiler. Here each distinct name is escaped once (the
names are the exporters' own, a few dozen), a label value is escaped only when it holds a
character that needs it, each label set of the page is written once (an MPU's labels recur in
every family of it), and the rest is one format per sample. The text is byte for byte
`generate_latest`'s (tests/test_exposition.py compares them on the agent's own page and on
hostile label values); a family with what only the library handles (OpenMetrics `_created`,
`_gsum`, `_gcount` samples, timestamps) is written by the library.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import generate_latest
from prometheus_client.core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.utils import floatToGoString

MAX_NAMES = 4096  # escaped names kept (a bound: the exporters' own names are a few dozen)
OPENMETRICS_SUFFIXES = ("_created", "_gsum", "_gcount")
TYPES = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}

_label_names: dict[str, str] = {}
_metric_names: dict[str, str] = {}


class _One:
    """One family as `generate_latest` takes a registry."""

    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> Iterable[Metric]:
        return [self.family]


def _escaped(cache: dict[str, str], name: str, escape: Callable[[str], str]) -> str:
    out = cache.get(name)
    if out is None:
        if len(cache) >= MAX_NAMES:
            cache.clear()
        out = cache[name] = escape(name)
    return out


def _value(v: str) -> str:
    if "\\" in v or "\n" in v or '"' in v:
        return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return v


def _family(metric: Metric, out: list[str], label_sets: dict[tuple[tuple[str, str], ...], str]) -> None:
    special = {metric.name + suffix for suffix in OPENMETRICS_SUFFIXES}
    if any(s.name in special or s.timestamp is not None for s in metric.samples):
        out.append(generate_latest(_One(metric)).decode("utf-8"))
        return
    mtype = metric.type
    name = metric.name + "_total" if mtype == "counter" else metric.name + "_info" if mtype == "info" else metric.name
    shown = _escaped(_metric_names, name, openmetrics.escape_metric_name)
    doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
    out.append(f"# HELP {shown} {doc}\n# TYPE {shown} {TYPES.get(mtype, mtype)}\n")
    for s in metric.samples:
        sample = _escaped(_metric_names, s.name, openmetrics.escape_metric_name)
        if s.labels:
            key = tuple(sorted(s.labels.items()))
            pairs = label_sets.get(key)
            if pairs is None:
                pairs = label_sets[key] = ",".join(
                    f'{_escaped(_label_names, k, openmetrics.escape_label_name)}="{_value(v)}"' for k, v in key
                )
            out.append(f"{sample}{{{pairs}}} {floatToGoString(s.value)}\n")
        else:
            out.append(f"{sample} {floatToGoString(s.value)}\n")


def text(families: Iterable[Metric]) -> bytes:
    """The families in the Prometheus text format, as `generate_latest` writes them."""
    out: list[str] = []
    label_sets: dict[tuple[tuple[str, str], ...], str] = {}  # this page's label sets, each written once
    for metric in families:
        _family(metric, out, label_sets)
    return "".join(out).encode("utf-8")
