"""What one uid's jobs can make the agent hold on its socket, and who makes room: the job caps
(`socket.max_jobs_per_uid`, `socket.max_jobs`) and the MPU-state caps
(`socket.max_mpu_states_per_uid`, `socket.max_mpu_states`). Past a cap, the uid's own
longest-disconnected jobs go early (`drop`, never another uid's: a job id stays its owner's
until it expires), else the registration is refused (BadMessage, with the cap's reason).
Called by the link server (mscale.daemon.link) before a registration changes anything.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from mscale.daemon.jobs import JobState
from mscale.daemon.settings import SocketSection
from mscale.link import BadMessage, Register

Drop = Callable[[str, str], None]  # (job_id, why): the link server's early expiry


def make_room(cfg: SocketSection, jobs: Mapping[str, JobState], uid: int, drop: Drop) -> None:
    """Room for one more job of `uid` under socket.max_jobs_per_uid and socket.max_jobs:
    that uid's own longest-disconnected job goes early if need be, never another uid's (a
    job id stays its owner's until it expires); else refused (uid_job_limit, job_limit)."""
    for why, key, cap in (
        ("uid_job_limit", "socket.max_jobs_per_uid", cfg.max_jobs_per_uid),
        ("job_limit", "socket.max_jobs", cfg.max_jobs),
    ):
        own = [(j.disconnected_at, k) for k, j in jobs.items() if j.uid == uid]
        held = len(own) if why == "uid_job_limit" else len(jobs)
        if held < cap:
            continue
        idle = [(t, k) for t, k in own if t is not None and not jobs[k].ranks]
        if not idle:
            whose = f"of uid {uid} " if why == "uid_job_limit" else ""
            raise BadMessage(why, f"register: {held} jobs {whose}kept ({key}); no other user's job is evicted")
        drop(min(idle)[1], key.removeprefix("socket."))


def check_mpu_budget(
    cfg: SocketSection, jobs: Mapping[str, JobState], uid: int, job: JobState | None, msg: Register, drop: Drop
) -> None:
    """What one uid can make the agent hold: MPU states (each a dozen series) at most
    socket.max_mpu_states_per_uid for the uid's jobs, socket.max_mpu_states in all, so a
    flood of registrations cannot blow /metrics up. Past either, the uid's own
    longest-disconnected jobs go early (never another uid's), else refused (uid_mpu_limit,
    mpu_state_limit)."""
    rs = job.rank_states.get(msg.rank) if job is not None else None
    adding = len(msg.mpus) - (len(rs.mpus) if rs is not None else 0)
    while adding > 0:
        total = own = 0
        for j in jobs.values():
            held = sum(len(r.mpus) for r in j.rank_states.values())
            total, own = total + held, own + (held if j.uid == uid else 0)
        over = [
            (why, key, held)
            for why, key, held, cap in (
                ("uid_mpu_limit", "socket.max_mpu_states_per_uid", own, cfg.max_mpu_states_per_uid),
                ("mpu_state_limit", "socket.max_mpu_states", total, cfg.max_mpu_states),
            )
            if held + adding > cap
        ]
        if not over:
            return
        idle = [
            (j.disconnected_at, k)
            for k, j in jobs.items()
            if j.uid == uid and j is not job and not j.ranks and j.disconnected_at is not None
        ]
        if not idle:
            why, key, held = over[0]
            whose = f" of uid {uid}" if why == "uid_mpu_limit" else ""
            raise BadMessage(why, f"register: the jobs{whose} hold {held} MPU states, {adding} more is past {key}")
        drop(min(idle)[1], over[0][1].removeprefix("socket."))
