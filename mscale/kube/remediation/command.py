"""Slurm or bare metal: a command the agent runs to file a fault and to undo it.

    [remediation.command]
    enabled = true
    argv = ["/usr/local/sbin/gpu-remediate", "--site", "dc1"]

The agent runs argv (no shell) with the facts appended as arguments,

    argv... EVENT NODE GPU_UUID GPU_INDEX KIND REASON ACTION

Only values the agent knows reach it: its node name, the GPU probe's index and UUID of the GPU,
the link's job, rank and MPU ids, a standby that is one of the node's GPU indexes; each is
checked again before the run, and a fault carrying anything else is not run (FilingFailed).
EVENT `file` or `clear`, KIND `sdc` or `xid`, REASON `GPUSilentDataCorruption` or
`GPUXid<code>`, ACTION NVSentinel's RecommendedAction name (COMPONENT_RESET, RESTART_BM,
CONTACT_SUPPORT), and in the environment, which holds nothing of the agent's own (no token
leaks into it) but PATH, LANG and:

    MSCALE_EVENT MSCALE_NODE MSCALE_GPU_UUID MSCALE_GPU_INDEX MSCALE_FAULT_KIND
    MSCALE_FAULT_REASON MSCALE_RECOMMENDED_ACTION MSCALE_FAULT_ID MSCALE_MESSAGE MSCALE_SINCE
    MSCALE_JOB_ID MSCALE_RANK MSCALE_MPU_ID MSCALE_STANDBY_GPU MSCALE_XID  (the last five: where known)

Exit 0 is done; anything else (or no exit within `timeout_s`: its process group is killed) is a
failure, retried after `remediation.retry_interval_s`. The command must itself be idempotent: a
`file` may come again for a fault (after an agent restart). Its exit status is a finding
(remediation_filing, `exit_code`) and the metric `mscale_remediation_command_exit_code`; its
output is read up to `max_output_bytes` (the rest is drained and dropped) and the tail logged.
For Slurm, such a script would `scontrol update nodename=NODE state=drain reason=...` on file
and `state=resume` on clear (docs/kubernetes.md#remediation-hand-off).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from dataclasses import dataclass
from typing import Any

from mscale.kube.remediation.base import CLEARED, FILED, FilerContext, FilerSpec, FilingFailed
from mscale.kube.remediation.verdicts import FACT_KEYS, FACT_VALUE, GPU_UUID, MAX_MESSAGE, Fault
from mscale.options import opt

NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")  # a host or Kubernetes node name
_WORD = re.compile(r"[A-Za-z0-9_]{1,64}")
_FACT_ENV = {"job_id": "JOB_ID", "rank": "RANK", "mpu_id": "MPU_ID", "standby_gpu": "STANDBY_GPU", "xid": "XID"}


@dataclass(frozen=True)
class CommandSection:
    """[remediation.command]"""

    argv: list[str] = opt(
        None, "the command and its first arguments (no shell); the facts are appended (see docs)", factory=list
    )
    timeout_s: float = opt(
        30.0, "the command must exit within this, else its process group is killed", min=0.1, max=3600
    )
    max_output_bytes: int = opt(
        4096, "bytes of the command's output kept for the log (the rest is read and dropped)", min=0, max=1 << 20
    )

    def check(self, key: str) -> None:
        from mscale.options import ConfigError

        enabled = getattr(self, "enabled", False)
        if enabled and not self.argv:
            raise ConfigError(f"{key}.argv: needed with {key}.enabled = true (the command to run)")
        if self.argv and not os.path.isabs(self.argv[0]):
            raise ConfigError(f"{key}.argv: the command must be an absolute path, got {self.argv[0]!r}")
        for i, a in enumerate(self.argv):
            if "\x00" in a or len(a) > 4096:
                raise ConfigError(f"{key}.argv[{i}]: expected at most 4096 characters and no NUL")


def facts(event: str, node: str, fault: Fault) -> tuple[list[str], dict[str, str]]:
    """The arguments appended to argv and the environment the command gets: the agent's own
    values only (its node name, the GPU probe's index and UUID, the link's job, rank and MPU
    ids), each checked here once more; FilingFailed for a fault that carries anything else."""
    _check(node, fault)
    args = [event, node, fault.gpu_uuid, str(fault.gpu), fault.kind, fault.reason, fault.action]
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
        "MSCALE_EVENT": event,
        "MSCALE_NODE": node,
        "MSCALE_GPU_UUID": fault.gpu_uuid,
        "MSCALE_GPU_INDEX": str(fault.gpu),
        "MSCALE_FAULT_KIND": fault.kind,
        "MSCALE_FAULT_REASON": fault.reason,
        "MSCALE_RECOMMENDED_ACTION": fault.action,
        "MSCALE_FAULT_ID": fault.fault_id,
        "MSCALE_MESSAGE": fault.message[:1024],
        "MSCALE_SINCE": f"{fault.since:.3f}",
    }
    for k, name in _FACT_ENV.items():
        if fault.facts.get(k):
            env[f"MSCALE_{name}"] = fault.facts[k]
    return args, env


def _check(node: str, fault: Fault) -> None:
    bad = []
    if not NODE.fullmatch(node):
        bad.append("the node name")
    if not GPU_UUID.fullmatch(fault.gpu_uuid):
        bad.append("the GPU UUID")
    if not 0 <= fault.gpu < 4096:
        bad.append("the GPU index")
    if not fault.message.isprintable() or len(fault.message) > MAX_MESSAGE:
        bad.append("the message")
    if fault.kind not in ("sdc", "xid") or not _WORD.fullmatch(fault.reason) or not _WORD.fullmatch(fault.action):
        bad.append("the kind, reason or action")
    for k, v in fault.facts.items():
        if k not in FACT_KEYS or not FACT_VALUE.fullmatch(v):
            bad.append(f"fact {k[:32]!r}")
    if bad:
        raise FilingFailed(
            f"not run: {', '.join(bad)} of GPU {fault.gpu}'s fault is not what the agent knows",
            labels={"exit_code": "none"},
        )


class CommandFiler:
    name, kinds = "command", ("sdc", "xid")

    def __init__(self, cfg: CommandSection, node: str) -> None:
        self.cfg, self.node = cfg, node
        self.last_exit: dict[str, int] = {}  # event -> the last exit status (-N: killed by signal N)
        self.last_output = ""

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def file(self, fault: Fault) -> str:
        await self._run("file", fault)
        return FILED

    async def clear(self, fault: Fault) -> str:
        await self._run("clear", fault)
        return CLEARED

    async def _run(self, event: str, fault: Fault) -> None:
        args, env = facts(event, self.node, fault)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.cfg.argv,
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                cwd="/",
                start_new_session=True,  # its own process group: a deadline kills its children too
            )
        except OSError as e:
            raise FilingFailed(f"cannot run {self.cfg.argv[0]}: {e}", labels={"exit_code": "none"}) from None
        assert proc.stdout is not None
        out = bytearray()
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                await _read_bounded(proc.stdout, out, self.cfg.max_output_bytes)
                rc = await proc.wait()
        except TimeoutError:
            _kill_group(proc)
            await _reap(proc)
            self.last_exit[event] = -signal.SIGKILL
            raise FilingFailed(
                f"{self.cfg.argv[0]} {event}: no exit within {self.cfg.timeout_s:g}s: killed",
                labels={"exit_code": str(-signal.SIGKILL), "timed_out": "true"},
            ) from None
        except BaseException:  # cancelled (the agent stops): leave nothing running
            _kill_group(proc)
            raise
        self.last_exit[event] = rc
        self.last_output = out.decode("utf-8", "replace")
        if rc != 0:
            tail = self.last_output.strip()[-300:]
            raise FilingFailed(
                f"{self.cfg.argv[0]} {event}: exit {rc}" + (f": {tail}" if tail else ""), labels={"exit_code": str(rc)}
            )


async def _read_bounded(stream: asyncio.StreamReader, out: bytearray, limit: int) -> None:
    """Read to EOF, keeping the first `limit` bytes (a chatty command cannot fill the agent's memory)."""
    while chunk := await stream.read(65536):
        room = limit - len(out)
        if room > 0:
            out += chunk[:room]


def _kill_group(proc: Any) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


async def _reap(proc: Any) -> None:
    try:
        async with asyncio.timeout(5):
            await proc.wait()
    except TimeoutError:  # unkillable (D state): the child watcher reaps it later
        pass


def _factory(section: CommandSection, ctx: FilerContext) -> CommandFiler:
    return CommandFiler(section, ctx.node)


SPEC = FilerSpec(
    "command",
    False,
    CommandSection,
    _factory,
    "run remediation.command.argv to file a GPU fault and to undo it (Slurm, bare metal)",
)
