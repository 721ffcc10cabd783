"""POST /api/v1/chaos: inject a fault into this agent's simulated node and its jobs.

Off by default: on only with `--simulate` (`agent.simulate`) or `chaos.enabled = true`;
off, every call is refused 403 (why="disabled"). On, a call must come from a loopback peer
(403, why="not_loopback"), pass the rules of every state-changing endpoint
(mscale.daemon.access: Host/Origin naming this agent, `Content-Type: application/json`) and
carry the chaos bearer token, `chaos.token` or MSCALE_CHAOS_TOKEN, compared in constant time
(none configured refuses every call). The body is at most MAX_BODY_BYTES; strings are bounded
(an MPU name or id MAX_MPU_CHARS, a job id as the link's job ids). Every refusal is counted in
`mscale_refused_messages_total{where="chaos"}` and changes nothing. A JSON body names the kind:

    corrupt     {mpu | gpu, mode: bitflip|noise|nan, steps, job_id?}  MPU output corruption
    loss_spike  {factor: 25, steps: 1, job_id?}                        the loss multiplied
    nan_loss    {steps: 1, job_id?}                                    the loss made NaN
    xid         {gpu, code: 79, corrupt?: noise|nan|none}              an Xid on a simulated GPU
    ecc         {gpu, corrupt?}                                        a double-bit ECC error
    hang        {seconds, job_id?}                                     the training loop stalls
    agent_kill  {}                                                     the agent dies (SIGKILL)

GPU faults go to the simulated GPUs (`SimNvml.inject`), so the GPU probe sees them as it
would a real one, and to the jobs, whose injector corrupts the outputs of the MPUs bound to
that GPU. Job faults go to the jobs as `{"type": "chaos", ...}` commands (the job's
`mscale.sim.chaos_job.ChaosPlugin` carries them out). Kinds, fields, modes and the command are
`mscale.link`'s, which `mscale chaos` uses too.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import signal
from typing import Any

from aiohttp import web

from mscale import link as protocol
from mscale.daemon import access, keys
from mscale.findings import Finding, Reason, Severity
from mscale.link import CHAOS_FIELDS
from mscale.link import CHAOS_KINDS as KINDS
from mscale.link import CHAOS_MODES as MODES

WHERE = "chaos"


MAX_BODY_BYTES = 4096  # the largest valid body is about 150 bytes
MAX_MPU_CHARS = 64
MPU_NAME = re.compile(rf"[A-Za-z0-9._:/-]{{1,{MAX_MPU_CHARS}}}")


class ChaosError(ValueError):
    pass


def enabled(config: Any) -> bool:
    """The chaos API is on: `chaos.enabled`, or an agent on simulated GPUs (`--simulate`)."""
    return bool(config.chaos.enabled or config.agent.simulate)


def _int(body: dict[str, Any], key: str, default: Any = None, lo: int = 0, hi: int = 1_000_000) -> int:
    v = body.get(key, default)
    if v is None:
        raise ChaosError(f"{key}: missing")
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ChaosError(f"{key}: expected an integer {lo}..{hi}, got {v!r}")
    return v


def _num(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ChaosError(f"{key}: expected a number {lo:g}..{hi:g}, got {v!r}")
    return float(v)


def _check_fields(body: dict[str, Any]) -> None:
    """Every field present is checked, whether the kind uses it or not: the event records them."""
    if "mpu" in body and not (isinstance(body["mpu"], str) and MPU_NAME.fullmatch(body["mpu"])):
        raise ChaosError(f"mpu: expected an MPU id or name (letters, digits, ._:/-; 1..{MAX_MPU_CHARS} characters)")
    if "job_id" in body and not (isinstance(body["job_id"], str) and protocol.JOB_ID.fullmatch(body["job_id"])):
        raise ChaosError(f"job_id: expected a job id matching {protocol.JOB_ID.pattern}")
    for key, choices in (("mode", MODES), ("corrupt", MODES + ("none",))):
        if key in body and (not isinstance(body[key], str) or body[key] not in choices):
            raise ChaosError(f"{key}: expected one of {', '.join(choices)}, got {str(body[key])[:40]!r}")
    if "gpu" in body:
        _int(body, "gpu", hi=1023)
    if "steps" in body:
        _int(body, "steps", lo=1)
    if "code" in body:
        _int(body, "code", lo=1, hi=65535)
    if "factor" in body:
        _num(body, "factor", 25.0, 1.0, 1e9)
    if "seconds" in body:
        _num(body, "seconds", 5.0, 0.0, 3600.0)


def gpu_count(nvml: Any) -> int:
    uuids = getattr(nvml, "uuids", None)
    if uuids is not None:
        return len(uuids)
    for attr in ("gpu_count", "gpus"):
        v = getattr(nvml, attr, None)
        if isinstance(v, int):
            return v
    timeline = getattr(nvml, "timeline", None)
    if timeline is not None:
        return int(timeline.gpus)
    return int(nvml.device_count())


def command_for(body: Any, nvml: Any = None) -> tuple[str, dict[str, Any], Any]:
    """Validate a chaos request: (kind, the job command or {}, the simulated GPU event or None)."""
    if not isinstance(body, dict):
        raise ChaosError("body: expected a JSON object")
    kind = body.get("kind")
    if kind not in KINDS:
        raise ChaosError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    extra = sorted(set(body) - set(CHAOS_FIELDS))
    if extra:
        raise ChaosError(f"unknown field(s): {', '.join(e[:40] for e in extra[:5])}")
    _check_fields(body)
    cmd: dict[str, Any] = protocol.Chaos(kind).to_wire() if kind in protocol.CHAOS_JOB_KINDS else {}
    event = None
    if kind == "corrupt":
        mode = body.get("mode", "noise")
        if mode not in MODES:
            raise ChaosError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}")
        if ("mpu" in body) == ("gpu" in body):
            raise ChaosError("corrupt needs exactly one of mpu (id or name) or gpu (index)")
        if "mpu" in body:
            if not isinstance(body["mpu"], str) or not MPU_NAME.fullmatch(body["mpu"]):
                raise ChaosError(
                    f"mpu: expected an MPU id or name (letters, digits, ._:/-; 1..{MAX_MPU_CHARS} characters)"
                )
            cmd["mpu"] = body["mpu"]
        else:
            cmd["gpu"] = _int(body, "gpu", hi=1023)
        cmd.update(mode=mode, steps=_int(body, "steps", 20, 1))
    elif kind == "loss_spike":
        cmd.update(factor=_num(body, "factor", 25.0, 1.0, 1e9), steps=_int(body, "steps", 1, 1))
    elif kind == "nan_loss":
        cmd.update(steps=_int(body, "steps", 1, 1))
    elif kind == "hang":
        cmd.update(seconds=_num(body, "seconds", 5.0, 0.0, 3600.0))
    elif kind in ("xid", "ecc"):
        if nvml is None or not hasattr(nvml, "inject"):
            raise ChaosError(f"{kind}: this agent has no simulated GPUs (start it with --simulate)")
        from mscale.sim.timeline import event_from_dict

        gpu = _int(body, "gpu", hi=1023)
        spec = (
            {"fault": "xid", "gpu": gpu, "code": _int(body, "code", 79, 1, 65535)}
            if kind == "xid"
            else {"fault": "ecc_dbe", "gpu": gpu}
        )
        try:
            event = event_from_dict(spec, gpus=gpu_count(nvml))
        except ValueError as e:
            raise ChaosError(str(e)) from None
        corrupt = body.get("corrupt", "noise")
        if corrupt not in MODES + ("none",):
            raise ChaosError(f"corrupt: expected one of {', '.join(MODES)}, none; got {corrupt!r}")
        cmd = protocol.Chaos("gpu_fault", gpu=gpu, mode=corrupt, fault=kind).to_wire() if corrupt != "none" else {}
    if "job_id" in body:
        if not isinstance(body["job_id"], str) or not protocol.JOB_ID.fullmatch(body["job_id"]):
            raise ChaosError(f"job_id: expected a job id matching {protocol.JOB_ID.pattern}")
        if cmd:
            cmd["job_id"] = body["job_id"]
    return kind, cmd, event


def is_loopback_peer(peer: Any) -> bool:
    """A TCP peer (host, port, ...) on a loopback address, or a Unix socket peer."""
    if peer is None:
        return False
    if isinstance(peer, (str, bytes)):  # a Unix socket peer is local
        return True
    try:
        return ipaddress.ip_address(str(peer[0]).split("%")[0]).is_loopback
    except (ValueError, IndexError, TypeError):
        return False


def _loopback(request: web.Request) -> bool:
    return is_loopback_peer(request.transport.get_extra_info("peername") if request.transport else None)


async def inject(request: web.Request) -> web.Response:
    app = request.app
    cfg = app[keys.CONFIG]
    try:
        if not enabled(cfg):
            raise access.Refused(
                403, "disabled", "the chaos API is off: start the agent with --simulate or set chaos.enabled"
            )
        if not _loopback(request):
            raise access.Refused(403, "not_loopback", "chaos is accepted from loopback peers only")
        body = await access.json_post(request, token=cfg.chaos.token, what="chaos", max_bytes=MAX_BODY_BYTES)
        kind, cmd, event = command_for(body, app[keys.NVML])
    except access.Refused as e:
        return access.refuse(request, WHERE, e)
    except ChaosError as e:
        return access.refuse(request, WHERE, access.Refused(400, "malformed", str(e)))
    state = app[keys.STATE]
    # the event carries what was validated, never the raw body
    labels = {k: str(v) for k, v in body.items() if k != "kind"}
    state.events.emit(
        Finding(
            WHERE,
            Reason.CHAOS_INJECTED,
            Severity.WARNING,
            f"chaos: {kind} {labels}",
            {"kind": kind, **labels},
            app[keys.CLOCK](),
        )
    )
    result: dict[str, Any] = {"injected": kind}
    if event is not None:
        await asyncio.to_thread(app[keys.NVML].inject, event)
        result["gpu_event"] = event.describe()
    if cmd:
        link = app.get(keys.LINK)
        job_id = cmd.pop("job_id", None)
        if link is None:
            result["delivered"] = 0
        elif job_id:
            result["delivered"] = int(bool(await link.send(job_id, cmd)))
        else:
            result["delivered"] = await link.broadcast(cmd)
    if kind == "agent_kill":
        # answer first, then die the hard way: the jobs must keep training without us
        asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGKILL)
        result["pid"] = os.getpid()
    return web.json_response(result)


def setup(app: web.Application) -> None:
    app.router.add_post("/api/v1/chaos", inject)
