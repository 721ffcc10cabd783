"""The /metrics page's own text writer (mscale.daemon.exposition) writes what prometheus_client's
`generate_latest` writes, byte for byte: on the agent's page with jobs, ranks and reports, on
label values that need escaping, and on the families only the library handles."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from mscale.daemon import exposition
from mscale.daemon.exporters import make_registry
from support.agent_state import state_with


class _Families:
    def __init__(self, families) -> None:
        self.families = families

    def collect(self):
        return self.families


def same_as_the_library(families) -> str:
    ours = exposition.text(families)
    assert ours == generate_latest(_Families(families))
    return ours.decode()


def test_the_agents_page_with_jobs_is_written_as_the_library_writes_it():
    state = state_with({"a": 1000, "team-b/run-1": 2000}, ranks=3)
    families = list(make_registry(state).collect())
    text = same_as_the_library(families)
    assert 'job_id="team-b/run-1"' in text
    assert sum(1 for _ in text_string_to_metric_families(text)) == len(families)


def test_label_values_that_need_escaping_and_every_family_type():
    hostile = ['a"b', "back\\slash", "new\nline", "ünï", "", '\\"\n']
    g = GaugeMetricFamily("t_gauge", 'help with \\ and\nnewline "quoted"', labels=["v", "a_b"])
    for i, v in enumerate(hostile):
        g.add_metric([v, str(i)], float(i) / 3)
    c = CounterMetricFamily("t_things", "a counter", labels=["v"])
    c.add_metric(["x"], 1e21)
    h = HistogramMetricFamily("t_seconds", "a histogram", labels=["job_id"])
    h.add_metric(['j"1'], buckets=[("0.5", 1), ("+Inf", 3)], sum_value=2.5)
    i = InfoMetricFamily("t_build", "an info", labels=["v"])
    i.add_metric(["x"], {"version": "1.0"})
    specials = GaugeMetricFamily("t_specials", "nan and infinities", labels=["k"])
    for k, v in (("nan", float("nan")), ("inf", float("inf")), ("ninf", float("-inf")), ("tiny", 1e-300)):
        specials.add_metric([k], v)
    text = same_as_the_library([g, c, h, i, specials])
    parsed = {
        s.labels.get("v"): s.value
        for f in text_string_to_metric_families(text)
        if f.name == "t_gauge"
        for s in f.samples
    }
    assert set(parsed) == set(hostile)  # every value reads back as it was


def test_library_only_families_are_left_to_the_library():
    registry = CollectorRegistry()
    Counter("t_requests", "with _created samples", registry=registry).inc()
    Histogram("t_latency_seconds", "with _created", registry=registry).observe(0.2)
    stamped = GaugeMetricFamily("t_stamped", "a sample with a timestamp")
    stamped.add_metric([], 1.0, timestamp=1234.5)
    text = same_as_the_library([*registry.collect(), stamped])
    assert "t_requests_created" in text and "t_stamped 1.0 1234500" in text
