"""`mscale chaos inject KIND ...`: inject a fault into a running agent (loopback) and its jobs.

The agent serves chaos only when started with --simulate (or chaos.enabled), and only with its
chaos token: set MSCALE_CHAOS_TOKEN, or pass --token-file (a file holding the agent's chaos.token).

mscale chaos inject corrupt --mpu vision --mode bitflip --steps 20
mscale chaos inject corrupt --gpu 3 --mode nan --steps 5
mscale chaos inject loss-spike --factor 25
mscale chaos inject nan-loss
mscale chaos inject xid --gpu 0 --code 79
mscale chaos inject ecc --gpu 2
mscale chaos inject hang --seconds 30
mscale chaos inject agent-kill
"""

from __future__ import annotations

import argparse
import os
import sys

from mscale.agent_client import AgentClient, AgentError
from mscale.link import CHAOS_FIELDS, CHAOS_KINDS, CHAOS_MODES, DEFAULT_URL

HELP = "inject a fault (MPU corruption, loss spike, NaN loss, Xid/ECC, hang, agent kill) into a running agent and job"
KINDS = tuple(k.replace("_", "-") for k in CHAOS_KINDS)  # the API's kinds, spelt as CLI words
TOKEN_ENV = "MSCALE_CHAOS_TOKEN"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="chaos_command", required=True, metavar="inject")
    inj = sub.add_parser(
        "inject", help="inject one fault", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    inj.add_argument("kind", choices=KINDS)
    inj.add_argument(
        "--agent", default=DEFAULT_URL, metavar="URL", help=f"the agent, loopback only (default {DEFAULT_URL})"
    )
    inj.add_argument("--job-id", help="only this job (default: every job)")
    inj.add_argument("--mpu", help="corrupt: MPU id or name")
    inj.add_argument("--gpu", type=int, help="corrupt/xid/ecc: simulated GPU index")
    inj.add_argument("--mode", choices=CHAOS_MODES, help="corrupt: how (default noise)")
    inj.add_argument("--steps", type=int, help="corrupt/loss-spike/nan-loss: for how many steps")
    inj.add_argument("--factor", type=float, help="loss-spike: multiplier (default 25)")
    inj.add_argument("--code", type=int, help="xid: the Xid code (default 79)")
    inj.add_argument(
        "--corrupt",
        choices=CHAOS_MODES + ("none",),
        help="xid/ecc: what the MPUs on that GPU compute meanwhile (default noise)",
    )
    inj.add_argument("--seconds", type=float, help="hang: how long (default 5)")
    inj.add_argument("--timeout", type=float, default=10.0, metavar="S")
    inj.add_argument(
        "--token-file",
        metavar="PATH",
        help=f"file holding the agent's chaos token (default: ${TOKEN_ENV})",
    )


def token_of(args: argparse.Namespace) -> str:
    """The chaos token: the first line of --token-file, else $MSCALE_CHAOS_TOKEN."""
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                return f.readline(4096).strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--token-file {args.token_file}: {e}") from None
    return os.environ.get(TOKEN_ENV, "").strip()


def body_of(args: argparse.Namespace) -> dict:
    body: dict = {"kind": args.kind.replace("-", "_")}
    for key in (f for f in CHAOS_FIELDS if f != "kind"):
        v = getattr(args, key, None)
        if v is not None:
            body[key] = v
    return body


def run(args: argparse.Namespace) -> int:
    try:
        client = AgentClient(args.agent, timeout=args.timeout, chaos_token=token_of(args))
        status, reply = client.chaos(body_of(args))
    except (AgentError, ValueError) as e:
        print(f"mscale chaos: {e}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"mscale chaos: refused ({status}): {reply.get('error', reply)}", file=sys.stderr)
        return 2 if status == 400 else 1
    parts = [f"injected {reply.get('injected')}"]
    if "gpu_event" in reply:
        parts.append(f"simulated GPU: {reply['gpu_event']}")
    if "delivered" in reply:
        parts.append(f"delivered to {reply['delivered']} job(s)")
    print("; ".join(parts))
    return 0
