"""The agent's commands to a job, and the standby exchange, one dataclass each (`to_wire`,
`from_wire`). A plugin may take command types beyond `Command`: the guard hands every command
to the plugins as the JSON object it came as, and each of the project's own plugins reads the
one it takes with its class's `from_wire`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from mscale.link.wire import (
    MAX_GPU_INDEX,
    MAX_INT,
    MPU_ID,
    Command,
    Wire,
    is_int,
    need,
    no_unknown,
    read_int,
    read_text,
)


def check_command(command: object) -> None:
    """A command is a dict with a string type (plugins may understand types beyond Command)."""
    if not isinstance(command, dict) or not isinstance(command.get("type"), str):
        raise ValueError("command: expected a dict with a string 'type'")


def _drop_none(d: dict[str, Any]) -> Wire:
    return {k: v for k, v in d.items() if v is not None}


@dataclass(frozen=True, slots=True)
class Ping:
    id: object

    def to_wire(self) -> Wire:
        return {"type": Command.PING.value, "id": self.id}


# --- heal --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Heal:
    """A healing decision for the fuse plugin (mscale.hook.fuse.fuse); `end`: end what the action
    started (a cooling window whose alert resolved). Fields left None are not sent."""

    action: str
    rule: str | None = None
    level: str | None = None
    mpu_id: str | None = None
    gpu: str | None = None
    gpu_uuid: str | None = None
    reason: str | None = None
    why: str | None = None
    fault_key: str | None = None
    decided_at: float | None = None
    end: bool | None = None

    def to_wire(self) -> Wire:
        return _drop_none({"type": Command.HEAL.value, **{f.name: getattr(self, f.name) for f in fields(self)}})

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> Heal:
        """The agent's command read back: the action a string, the text fields as strings."""
        no_unknown(msg, HEAL_FIELDS | {"type", "action"}, "heal")
        need(isinstance(msg.get("action"), str), "heal: action must be a string")
        text = {k: str(msg[k]) for k in HEAL_FIELDS if k in msg and k not in ("decided_at", "end")}
        at = msg.get("decided_at")
        return cls(
            action=str(msg["action"]),
            **text,
            decided_at=float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else None,
            end=bool(msg["end"]) if "end" in msg else None,
        )


# the fields a heal command may carry besides type and action
HEAL_FIELDS = frozenset(f.name for f in fields(Heal)) - {"action"}


# --- chaos -------------------------------------------------------------------------------------

# chaos: the kinds `POST /api/v1/chaos` takes (`mscale chaos inject` spells them with "-"),
# its fields, the corruption modes, and the kinds a job's chaos command carries
CHAOS_KINDS = ("corrupt", "loss_spike", "nan_loss", "xid", "ecc", "hang", "agent_kill")
CHAOS_FIELDS = ("kind", "job_id", "mpu", "gpu", "mode", "steps", "factor", "code", "corrupt", "seconds")
CHAOS_MODES = ("bitflip", "noise", "nan")
CHAOS_JOB_KINDS = ("corrupt", "gpu_fault", "loss_spike", "nan_loss", "hang")


@dataclass(frozen=True, slots=True)
class Chaos:
    """A fault for a job's chaos plugin (mscale.sim.chaos_job); fields left None are not sent.
    `fault` names the GPU fault behind a gpu_fault (xid, ecc); `job_id` the job it was meant for."""

    kind: str
    mpu: str | None = None
    gpu: int | None = None
    mode: str | None = None
    steps: int | None = None
    factor: float | None = None
    seconds: float | None = None
    fault: str | None = None
    job_id: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in CHAOS_JOB_KINDS:
            raise ValueError(f"chaos command: kind {self.kind!r} is not one of {', '.join(CHAOS_JOB_KINDS)}")

    def to_wire(self) -> Wire:
        return _drop_none({"type": Command.CHAOS.value, **{f.name: getattr(self, f.name) for f in fields(self)}})

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> Chaos:
        """The command read back; ValueError or TypeError when it is not one (the plugin's reply)."""
        return cls(**{k: v for k, v in msg.items() if k != "type"})

    def injection(self) -> dict[str, Any]:
        """The fields the chaos plugin's `inject` takes."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "job_id" and getattr(self, f.name) is not None
        }


# --- standby (mscale.daemon.standby, mscale.hook.fuse.standby) -----------------------------------------
# a standby GPU for an L1 swap, from the agent's node view: the job asks, the agent answers that rank

STANDBY_REQUEST = "standby_request"  # job -> agent
STANDBY = "standby"  # agent -> job
STANDBY_REQUEST_FIELDS = frozenset({"type", "id", "mpu_id", "gpu", "avoid"})
MAX_AVOID = 256


@dataclass(frozen=True, slots=True)
class StandbyRequest:
    """The job asks for a GPU for one MPU leaving `gpu`, none of `avoid`."""

    id: int
    mpu_id: str
    gpu: int
    avoid: tuple[int, ...] = ()

    def to_wire(self) -> Wire:
        return {
            "type": STANDBY_REQUEST,
            "id": self.id,
            "mpu_id": self.mpu_id,
            "gpu": self.gpu,
            "avoid": sorted(set(self.avoid)),
        }

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> StandbyRequest:
        no_unknown(msg, STANDBY_REQUEST_FIELDS, "standby_request")
        ident = read_int(msg, "id", f"standby_request: id must be an integer in 0..{MAX_INT}", default=-1)
        mpu_id = read_text(msg, "mpu_id", "standby_request: mpu_id must be 1-16 of [A-Za-z0-9._-]", 1, 16, MPU_ID)
        gpu = read_int(msg, "gpu", "standby_request: gpu must be a GPU index", 0, MAX_GPU_INDEX - 1, default=-1)
        avoid = msg.get("avoid", [])
        need(
            isinstance(avoid, list) and len(avoid) <= MAX_AVOID and all(is_int(g, 0, MAX_GPU_INDEX - 1) for g in avoid),
            f"standby_request: avoid must be a list of at most {MAX_AVOID} GPU indexes",
        )
        return cls(ident, mpu_id, gpu, tuple(int(g) for g in avoid))


@dataclass(frozen=True, slots=True)
class Standby:
    """The agent's answer: a GPU (None: none), why, and whether it decided (False: no node view)."""

    id: int
    gpu: int | None
    gpu_uuid: str = ""
    why: str = ""
    decided: bool = True

    def to_wire(self) -> Wire:
        return {
            "type": STANDBY,
            "id": self.id,
            "gpu": self.gpu,
            "gpu_uuid": self.gpu_uuid,
            "why": self.why,
            "decided": self.decided,
        }

    @classmethod
    def from_wire(cls, msg: Mapping[str, Any]) -> Standby:
        gpu = msg.get("gpu")
        ident = msg.get("id", -1)
        return cls(
            ident if is_int(ident) else -1,
            gpu if is_int(gpu, 0, MAX_GPU_INDEX - 1) else None,
            str(msg.get("gpu_uuid", "")),
            str(msg.get("why", "")),
            bool(msg.get("decided", True)),
        )
