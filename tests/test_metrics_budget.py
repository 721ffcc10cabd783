"""Issue 25 item 5, the /metrics page: what one job or one uid can put on it is bounded (series
per job, per uid, the page's bytes), what the caps left out is counted, and the agent's own
series are always there. The render over real collectors and real job states, then a real agent
whose jobs register over its socket and are scraped over HTTP."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from mscale.daemon import scrape
from mscale.daemon.exporters import make_registry
from mscale.daemon.settings import HttpSection
from support.agent_state import MPUS, state_with
from support.link_agent import Agent, RawLink, metric


def page_of(state, **caps) -> tuple[str, dict[str, Counter], dict[str, float]]:
    """(the page, series per job_id by family, mscale_metrics_series_omitted by why)."""
    families = list(make_registry(state).collect())
    uid_of = {j: job.uid for j, job in state.jobs.items()}
    limits = {"per_job": 1 << 20, "per_uid": 1 << 20, "max_bytes": 1 << 30} | caps
    text = scrape.render(families, scrape.Budget(uid_of=uid_of, **limits)).decode()
    per_job: dict[str, Counter] = {}
    omitted = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "job_id" in s.labels and not s.name.endswith(("_bucket", "_sum", "_count", "_created")):
                per_job.setdefault(s.labels["job_id"], Counter())[fam.name] += 1
            if fam.name == "mscale_metrics_series_omitted":
                omitted[s.labels["why"]] = s.value
    return text, per_job, omitted


def own_families(text: str) -> set[str]:
    """Families with a sample and no job_id label: the agent's own, GPUs, host."""
    return {
        fam.name
        for fam in text_string_to_metric_families(text)
        if fam.samples and not any("job_id" in s.labels for s in fam.samples)
    }


def test_series_per_job_are_capped_and_the_rest_counted():
    state = state_with({"a": 1000, "b": 1000, "c": 2000})
    full, full_jobs, none_left_out = page_of(state)
    assert none_left_out == dict.fromkeys(scrape.WHYS, 0.0)
    per_job = sum(full_jobs["a"].values())
    assert per_job > 100
    text, jobs, omitted = page_of(state, per_job=100)
    assert all(sum(c.values()) == 100 for c in jobs.values()), {j: sum(c.values()) for j, c in jobs.items()}
    assert omitted["job_series_limit"] == 3 * (per_job - 100)
    # the agent's own series are all there
    assert own_families(text) >= own_families(full) - {"mscale_metrics_page_bytes"}


def test_series_per_uid_are_capped_and_another_uid_keeps_its_own():
    state = state_with({"a": 1000, "b": 1000, "c": 2000})
    _, full_jobs, _ = page_of(state)
    per_job = sum(full_jobs["a"].values())
    _, jobs, omitted = page_of(state, per_uid=per_job)  # uid 1000 holds two jobs' worth
    # uid 1000 keeps one job's worth of series in all (in page order), uid 2000 its whole job
    assert sum(jobs["a"].values()) + sum(jobs["b"].values()) == per_job
    assert sum(jobs["c"].values()) == per_job
    assert omitted["uid_series_limit"] == per_job and omitted["job_series_limit"] == 0


def test_the_page_is_kept_under_its_byte_cap_and_the_agents_own_series_stay():
    state = state_with({f"job-{i}": 1000 + i for i in range(6)}, ranks=4)
    full, _, _ = page_of(state)
    cap = len(full) // 2
    text, jobs, omitted = page_of(state, max_bytes=cap)
    size = metric(text, "mscale_metrics_page_bytes")
    assert size <= cap and size == len(text.split("# HELP mscale_metrics_series_omitted")[0].encode())
    assert omitted["page_bytes_limit"] > 0 and jobs  # some jobs' series were kept, the rest left out
    assert own_families(text) >= own_families(full) - {"mscale_metrics_page_bytes"}


def test_a_histograms_series_are_kept_or_left_out_together():
    from prometheus_client.core import HistogramMetricFamily

    h = HistogramMetricFamily("t_seconds", "test", labels=["job_id"])
    for j in ("a", "b", "c"):
        h.add_metric([j], buckets=[("1.0", 1), ("+Inf", 2)], sum_value=3.0)
    budget = scrape.Budget(per_job=1 << 20, per_uid=1, max_bytes=1 << 30, uid_of=dict.fromkeys("abc", 7))
    text = scrape.render([h], budget).decode()
    kept = [s for fam in text_string_to_metric_families(text) if fam.name == "t_seconds" for s in fam.samples]
    assert {s.labels["job_id"] for s in kept} == {"a"} and len(kept) == 4  # two buckets, sum, count
    assert budget.omitted["uid_series_limit"] == 2  # b and c, each one series


def test_a_real_agent_scraped_over_http_keeps_its_caps(tmp_path: Path):
    sock = str(tmp_path / "run" / "agent.sock")
    http = HttpSection(metrics_max_series_per_job=60, metrics_max_series_per_uid=200)
    agent = Agent(sock, sections={"http": http}, max_mpu_states=4096, max_mpu_states_per_uid=4096)
    links = []
    try:
        for i in range(2):
            links.append(RawLink(sock))
            reg = {"type": "register", "job_id": f"j{i}", "rank": 0, "pid": 1, "step": 0, "mpus": MPUS}
            assert json.loads(links[-1].ask(json.dumps(reg)))["type"] == "registered"
        page = agent.metrics()
        per_job = Counter(re.findall(r'job_id="(j\d)"', page))
        assert per_job == {"j0": 60, "j1": 60}, per_job
        assert metric(page, 'mscale_metrics_series_omitted{why="job_series_limit"}') > 0
        for i in range(2, 4):  # the uid's third and fourth jobs: past its cap of 200
            links.append(RawLink(sock))
            reg = {"type": "register", "job_id": f"j{i}", "rank": 0, "pid": 1, "step": 0, "mpus": MPUS}
            assert json.loads(links[-1].ask(json.dumps(reg)))["type"] == "registered"
        page = agent.metrics()
        assert len(re.findall(r'job_id="j\d"', page)) == 200
        assert metric(page, 'mscale_metrics_series_omitted{why="uid_series_limit"}') > 0
        assert metric(page, "mscale_agent_start_time_seconds") > 0
    finally:
        for raw in links:
            raw.close()
        agent.stop()
