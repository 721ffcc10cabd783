"""The agent's own metrics: probe meta-metrics, events, refused input."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mscale.daemon.state import AgentState


def collect(state: AgentState) -> Iterable[Metric]:
    up = GaugeMetricFamily("mscale_probe_up", "1 if the probe's last sample succeeded", labels=["probe"])
    dur = GaugeMetricFamily("mscale_probe_duration_seconds", "duration of the probe's last sample", labels=["probe"])
    last = GaugeMetricFamily(
        "mscale_probe_last_success_timestamp_seconds",
        "Unix time of the probe's last successful sample",
        labels=["probe"],
    )
    errors = CounterMetricFamily("mscale_probe_errors", "samples that raised or timed out", labels=["probe"])
    for name, st in sorted(state.probe_status.items()):
        if not st.enabled:  # switched off in config: no data, not a failure
            continue
        up.add_metric([name], 1.0 if st.up else 0.0)
        dur.add_metric([name], st.last_duration_s)
        last.add_metric([name], st.last_success_time)
        errors.add_metric([name], st.errors_total)
    yield from (up, dur, last, errors)

    events = CounterMetricFamily(
        "mscale_events", "findings emitted, by source, reason and severity", labels=["source", "reason", "severity"]
    )
    for (source, reason, severity), n in sorted(state.events.counts.items()):
        events.add_metric([source, reason, severity], n)
    yield events

    refused = CounterMetricFamily(
        "mscale_refused_messages", "input refused, by where it came and why", labels=["where", "why"]
    )
    for (where, why), n in sorted(state.refused.items()):
        refused.add_metric([where, why], n)
    yield refused

    # No node label here: the scrape config sets `node` on every series of the target.
    info = GaugeMetricFamily("mscale_agent_start_time_seconds", "Unix time the agent started")
    info.add_metric([], state.started_at)
    yield info
