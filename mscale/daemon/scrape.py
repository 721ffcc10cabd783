"""GET /metrics: one render at a time, formatted off the event loop, within the page budget.

- The collectors run on the event loop: they read the agent's live state, which only the loop
  changes (about 0.1 s at the MPU-state caps). Formatting the text, the bulk of a render (about
  0.3 s there, by mscale.daemon.exposition; benchmarks/metrics_at_caps.py), runs in a worker thread, so /healthz, the webhook and the hook socket are served
  meanwhile.
- One render in flight: a scrape that arrives while one runs is answered with that render's
  page, so many concurrent scrapes (64 slow readers asking for /metrics in a loop) cost one
  render, not one each. `http.metrics_reuse_s` (0: off) also reuses a finished page for that long.
- The page is written in chunks of CHUNK bytes, each drained before the next, so a connection
  whose reader is slow holds one chunk, not the page (and the write deadline of
  mscale.daemon.httpserver closes it).
- The budget: what one job or one uid can put on the page. Series with a `job_id` label are
  kept at most `http.metrics_max_series_per_job` per job and `http.metrics_max_series_per_uid`
  for the jobs of one uid, and while the page is under `http.metrics_max_bytes`; the rest are
  left out, counted by cap in `mscale_metrics_series_omitted{why}` (job_series_limit,
  uid_series_limit, page_bytes_limit). Series without `job_id` (the agent's own, GPUs, host)
  are bounded by the hardware and always kept. A histogram's series (buckets, sum, count) are
  kept or left out together. `mscale_metrics_page_bytes` is the size of the page above it.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import GaugeMetricFamily, Metric

from mscale.daemon import exposition, keys

CHUNK = 64 * 1024  # bytes written per drain
RENDER_TIMEOUT_S = 30.0  # a scrape waits this long for its render, then is answered 503
SAMPLE_OVERHEAD = 24  # bytes of a sample line besides its name and labels: value, braces, newline
WHYS = ("job_series_limit", "uid_series_limit", "page_bytes_limit")
GROUPED = frozenset({"histogram", "gaugehistogram", "summary"})  # families whose series span samples


class Budget:
    """The caps of one render (see the module doc); `omitted` counts what they left out."""

    def __init__(self, *, per_job: int, per_uid: int, max_bytes: int, uid_of: dict[str, Any]) -> None:
        self.per_job, self.per_uid, self.max_bytes, self.uid_of = per_job, per_uid, max_bytes, uid_of
        self.by_job: Counter[str] = Counter()
        self.by_uid: Counter[Any] = Counter()
        self.bytes = 0
        self.omitted: Counter[str] = Counter()

    def admit(self, job_id: str, size: int) -> bool:
        uid = self.uid_of.get(job_id)
        why = (
            "job_series_limit"
            if self.by_job[job_id] >= self.per_job
            else "uid_series_limit"
            if self.by_uid[uid] >= self.per_uid
            else "page_bytes_limit"
            if self.bytes + size > self.max_bytes
            else ""
        )
        if why:
            self.omitted[why] += 1
            return False
        self.by_job[job_id] += 1
        self.by_uid[uid] += 1
        return True

    def apply(self, families: Iterable[Metric]) -> list[Metric]:
        """The families with the series past a cap left out; runs in the render thread (the
        families are this render's own objects)."""
        out = []
        for family in families:
            self.bytes += len(family.name) * 2 + len(family.documentation) + 48  # HELP and TYPE lines
            grouped = family.type in GROUPED
            kept: list[Any] = []
            decided: dict[tuple[tuple[str, str], ...], bool] = {}
            for s in family.samples:
                labels = s.labels
                size = (
                    len(s.name)
                    + SAMPLE_OVERHEAD
                    + 4 * len(labels)
                    + sum(map(len, labels))
                    + sum(map(len, labels.values()))
                )
                job_id = labels.get("job_id")
                if job_id is not None:
                    if grouped:  # one decision for a histogram's buckets, sum and count
                        group = tuple(sorted((k, v) for k, v in labels.items() if k not in ("le", "quantile")))
                        keep = decided.get(group)
                        if keep is None:
                            keep = decided[group] = self.admit(job_id, size)
                    else:
                        keep = self.admit(job_id, size)
                    if not keep:
                        continue
                self.bytes += size
                kept.append(s)
            if len(kept) == len(family.samples):
                out.append(family)
            else:
                trimmed = Metric(family.name, family.documentation, family.type, family.unit)
                trimmed.samples = kept
                out.append(trimmed)
        return out


def render(families: list[Metric], budget: Budget) -> bytes:
    """The page: the families within the budget, then the budget's own figures."""
    page = exposition.text(budget.apply(families))
    omitted = GaugeMetricFamily(
        "mscale_metrics_series_omitted",
        "series with a job_id left out of this page by the page budget (http.metrics_max_*), by cap",
        labels=["why"],
    )
    for why in WHYS:
        omitted.add_metric([why], budget.omitted[why])
    size = GaugeMetricFamily("mscale_metrics_page_bytes", "bytes of this /metrics page above this family")
    size.add_metric([], len(page))
    return page + exposition.text([omitted, size])


class MetricsPage:
    """The /metrics page of one app: single-flight, off-loop formatting, the budget."""

    def __init__(self, app: web.Application, clock: Callable[[], float] = time.monotonic) -> None:
        self.app, self.clock = app, clock
        self._inflight: asyncio.Future[bytes] | None = None
        self._page: bytes | None = None
        self._at = 0.0

    async def get(self) -> bytes:
        reuse_s = self.app[keys.CONFIG].http.metrics_reuse_s
        if self._page is not None and reuse_s > 0 and self.clock() - self._at < reuse_s:
            return self._page
        if self._inflight is None:
            self._inflight = asyncio.ensure_future(self._render())
            self._inflight.add_done_callback(self._done)
        # shielded: a scrape that gives up does not cancel the render the others wait for
        async with asyncio.timeout(RENDER_TIMEOUT_S):
            return await asyncio.shield(self._inflight)

    def _done(self, fut: asyncio.Future[bytes]) -> None:
        self._inflight = None
        if not fut.cancelled() and fut.exception() is None:
            self._page, self._at = fut.result(), self.clock()

    async def _render(self) -> bytes:
        state, cfg = self.app[keys.STATE], self.app[keys.CONFIG].http
        families = list(self.app[keys.REGISTRY].collect())  # on the loop: reads live state
        budget = Budget(
            per_job=cfg.metrics_max_series_per_job,
            per_uid=cfg.metrics_max_series_per_uid,
            max_bytes=cfg.metrics_max_bytes,
            uid_of={job_id: getattr(job, "uid", None) for job_id, job in state.jobs.items()},
        )
        return await asyncio.to_thread(render, families, budget)


PAGE = web.AppKey("metrics_page", MetricsPage)


async def metrics(request: web.Request) -> web.StreamResponse:
    try:
        page = await request.app[PAGE].get()
    except TimeoutError:
        raise web.HTTPServiceUnavailable(text=f"the /metrics render took over {RENDER_TIMEOUT_S:.0f} s") from None
    resp = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE_LATEST})
    resp.content_length = len(page)
    view = memoryview(page)
    last = max(0, (len(page) - 1) // CHUNK * CHUNK)
    try:
        await resp.prepare(request)
        for start in range(0, last, CHUNK):
            await resp.write(view[start : start + CHUNK])  # drains past a chunk in the buffer
        await resp.write_eof(page[last:])  # and drains the rest (write_eof() with no data does not)
    except ConnectionError:  # closed meanwhile (a deadline, an eviction, the reader): nobody to tell
        pass
    return resp


def setup(app: web.Application) -> None:
    app[PAGE] = MetricsPage(app)
    app.router.add_get("/metrics", metrics)
