"""An agent's state holding registered jobs, built in the test's process (no socket)."""

from __future__ import annotations

from mscale.daemon.app import new_state
from mscale.daemon.config import Config
from mscale.daemon.jobs import JobState
from mscale.link import Register

MPUS = [{"mpu_id": f"{m:03d}", "name": f"mpu{m}", "gpu": m % 8} for m in range(8)]


def state_with(jobs: dict[str, int], ranks: int = 2):
    """An agent state holding `jobs` (job id -> owner uid), each with `ranks` ranks of 8 MPUs."""
    state = new_state(Config())
    for job_id, uid in jobs.items():
        job = JobState(job_id=job_id, uid=uid)
        for r in range(ranks):
            job.register(
                Register.from_wire(
                    {"job_id": job_id, "rank": r, "pid": 100 + r, "step": 0, "local_rank": r, "mpus": MPUS}
                )
            )
            job.ranks[r] = 100 + r
        state.jobs[job_id] = job
    return state
