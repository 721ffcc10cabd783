"""The agent's own config sections: [agent], [socket] (the hook library's link) and
[webhook] (Alertmanager), [stragglers] (slow ranks and MPUs). Assembled into `mscale.daemon.config.Config` with the other rooms'."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mscale.link import DEFAULT_LISTEN, DEFAULT_SOCKET, MAX_MESSAGE_BYTES, MAX_MPUS
from mscale.options import opt


@dataclass(frozen=True)
class AgentSection:
    HELP: ClassVar[str] = "the agent process"
    listen: str = opt(DEFAULT_LISTEN, "HTTP listen address HOST:PORT for /metrics and the API (port 0 picks one)")
    socket_path: str = opt(DEFAULT_SOCKET, "Unix socket the hook library connects to")
    node: str = opt("", "node name in labels and events (empty: the host name)")
    simulate: str = opt("", "fault timeline YAML: run on simulated GPUs instead of NVML (empty: real GPUs)")
    log_level: str = opt("info", "log level", choices=("debug", "info", "warning", "error"))
    event_history: int = opt(1000, "events kept for GET /api/v1/events", min=10, max=1_000_000)
    event_history_bytes: int = opt(
        16 << 20, "bytes of event history kept (messages and labels); the oldest go first", min=1 << 16, max=1 << 32
    )
    shutdown_timeout_s: float = opt(
        5.0, "longest a clean shutdown may take before tasks are cancelled", min=0.1, max=120
    )


@dataclass(frozen=True)
class SocketSection:
    HELP: ClassVar[str] = "the hook library's Unix socket"
    allowed_uids: list[int] = opt(
        None,
        "extra user ids (integers) allowed on the socket besides the agent's own and root",
        min=0,
        max=(1 << 32) - 2,
        factory=list,
    )
    max_message_bytes: int = opt(
        MAX_MESSAGE_BYTES, "larger messages on the socket are refused and counted", min=1024, max=1 << 30
    )
    mode: int = opt(0o660, "file mode of the socket", min=0, max=0o777)
    job_expiry_s: float = opt(
        600.0, "a disconnected job's state and series are removed this long after it left", min=0.1, max=30 * 86400
    )
    max_jobs: int = opt(256, "jobs the agent keeps; past it a new job is refused and counted", min=1, max=100_000)
    max_jobs_per_uid: int = opt(
        64, "jobs of one uid the agent keeps; past it that uid's new job is refused and counted", min=1, max=100_000
    )
    max_ranks_per_job: int = opt(
        64, "live connections (ranks) of one job; past it a registration is refused and counted", min=1, max=4096
    )
    max_mpus_per_job: int = opt(
        MAX_MPUS, "MPUs one job may register; past it the registration is refused and counted", min=1, max=MAX_MPUS
    )
    max_mpu_states: int = opt(
        2048,
        "MPU states (job x rank x MPU) kept in all; past it a registration is refused and counted",
        min=1,
        max=1 << 20,
    )
    max_mpu_states_per_uid: int = opt(
        1024,
        "MPU states the jobs of one uid may hold; past it its registration is refused and counted",
        min=1,
        max=1 << 20,
    )
    max_connections: int = opt(
        1024, "open hook-socket connections at most (also kept below the open-files limit)", min=4, max=1_000_000
    )
    max_connections_per_uid: int = opt(
        256,
        "open hook-socket connections from one uid at most; past it a new one is closed at once",
        min=1,
        max=1_000_000,
    )
    handshake_timeout_s: float = opt(
        10.0, "a new hook-socket connection must complete its websocket handshake within this", min=0.1, max=600
    )
    register_timeout_s: float = opt(
        10.0, "a hook-socket connection that has not registered a job within this is closed", min=0.1, max=600
    )


@dataclass(frozen=True)
class WebhookSection:
    HELP: ClassVar[str] = "the Alertmanager webhook"
    token: str = opt("", "bearer token Alertmanager must send (or env MSCALE_WEBHOOK_TOKEN); empty refuses every call")
    max_body_bytes: int = opt(1 << 20, "larger webhook bodies are refused", min=1024, max=1 << 30)
    max_actions_per_minute: int = opt(30, "rate limit on actions triggered by alerts", min=1, max=100000)


@dataclass(frozen=True)
class ChaosSection:
    HELP: ClassVar[str] = "the chaos API (fault injection)"
    enabled: bool = opt(
        False, "serve the chaos API (POST /api/v1/chaos); also on with --simulate (agent.simulate); off: refused 403"
    )
    token: str = opt("", "bearer token chaos calls must send (or env MSCALE_CHAOS_TOKEN); empty refuses every call")


@dataclass(frozen=True)
class HttpSection:
    HELP: ClassVar[str] = "HTTP timeouts, connection caps, Host names, the /metrics page budget"
    idle_timeout_s: float = opt(30.0, "an idle HTTP keep-alive connection is closed after this", min=1, max=3600)
    header_timeout_s: float = opt(
        10.0, "a new HTTP connection must send its first request head within this, or it is closed", min=0.5, max=600
    )
    body_timeout_s: float = opt(
        10.0, "a POST body must arrive within this, or the request is refused 408", min=0.5, max=600
    )
    max_connections: int = opt(
        512, "open HTTP connections at most (also kept below the open-files limit)", min=4, max=1_000_000
    )
    max_connections_per_peer: int = opt(64, "open HTTP connections from one peer address at most", min=2, max=1_000_000)
    write_timeout_s: float = opt(
        10.0,
        "a connection whose peer reads nothing of a response for this long is closed (a slow reader)",
        min=0.5,
        max=600,
    )
    metrics_reuse_s: float = opt(
        0.0, "a rendered /metrics page is reused for this long (0: every scrape renders, one at a time)", min=0, max=60
    )
    metrics_max_series_per_job: int = opt(
        16_384, "series with one job_id on /metrics at most; past it they are left out and counted", min=1, max=1 << 24
    )
    metrics_max_series_per_uid: int = opt(
        24_576,
        "series of the jobs of one uid on /metrics at most; past it they are left out and counted",
        min=1,
        max=1 << 24,
    )
    metrics_max_bytes: int = opt(
        4 << 20,
        "size of /metrics at most; past it the jobs' series are left out and counted (the agent's own are kept)",
        min=1 << 16,
        max=1 << 30,
    )
    allowed_hosts: list = opt(  # type: ignore[type-arg]  # bare: check() names a bad item itself
        None,
        "extra Host names (NAME or NAME:PORT) state-changing requests may use, besides the listen address, "
        "loopback names on loopback and the node's name",
        factory=list,
    )

    def check(self, key: str) -> None:
        from mscale.options import ConfigError

        if self.max_connections_per_peer > self.max_connections:
            raise ConfigError(
                f"{key}.max_connections_per_peer: expected at most {key}.max_connections "
                f"({self.max_connections}), got {self.max_connections_per_peer}"
            )
        for i, h in enumerate(self.allowed_hosts):
            if not isinstance(h, str) or not h or len(h) > 255 or any(c.isspace() or c in "/@?#" for c in h):
                raise ConfigError(f"{key}.allowed_hosts[{i}]: expected a host name or NAME:PORT, got {h!r}")


@dataclass(frozen=True)
class StragglerSection:
    HELP: ClassVar[str] = "slow ranks and slow MPUs, against the job's other ranks"

    enabled: bool = opt(True, "compare each rank's and each MPU's time with the job's other ranks on this node")
    ratio: float = opt(
        1.5, "a rank's time over the median of the other ranks' that makes it a straggler", min=1.01, max=100
    )
    min_excess_s: float = opt(
        0.005, "and by at least this many seconds (timing noise of small MPUs is not slowness)", min=0, max=60
    )
    window_steps: int = opt(20, "steps each rank's time is taken over", min=2, max=10_000)
    quantile: float = opt(
        0.25, "the quantile of each rank's window that is compared: 0.25, slow in 3 of 4 of its steps", min=0, max=1
    )
    evaluate_every_steps: int = opt(
        5, "the verdict is taken every this many compared steps (the windows take every step)", min=1, max=1000
    )
    warmup_steps: int = opt(
        5, "a job's first compared steps left out (allocation, compilation, caches)", min=0, max=10_000
    )
    min_ranks: int = opt(2, "ranks of a job that must report a step before it is compared", min=2, max=100_000)
