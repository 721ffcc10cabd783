"""Goodput and badput per job and rank: the seconds each rank's step reports carry by cause
(mscale.hook.core.goodput measures them; mscale.link TIME_CAUSES), summed here since the rank
registered, for mscale.daemon.exporters.goodput. A job the agent no longer holds goes with it."""

from __future__ import annotations

from typing import Any

from mscale.daemon.jobs import JobState
from mscale.daemon.keys import LINK, STATE
from mscale.link import StepReport

SOURCE = "goodput"


class GoodputBook:
    def __init__(self, state: Any) -> None:
        self.state = state
        self.seconds: dict[str, dict[int, dict[str, float]]] = {}  # job -> rank -> cause -> seconds

    def observe(self, job: JobState, rank: int, report: StepReport) -> None:
        seconds = report.seconds
        if not seconds:
            return
        counter = self.seconds.setdefault(job.job_id, {}).setdefault(rank, {})
        for cause, s in seconds.items():  # validated by mscale.link: known causes, finite, >= 0
            counter[cause] = counter.get(cause, 0.0) + s

    def view(self) -> dict[str, dict[int, dict[str, float]]]:
        for job_id in [j for j in self.seconds if j not in self.state.jobs]:
            del self.seconds[job_id]
        return self.seconds


def setup(app: Any) -> None:
    link = app.get(LINK)
    if link is None:
        return
    book = GoodputBook(app[STATE])
    link.on_report(book.observe)
    app[STATE].publish(SOURCE, book)  # the exporter asks it for its view
