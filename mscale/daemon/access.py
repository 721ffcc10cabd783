"""Who may change the agent's state over HTTP: the rules every state-changing endpoint applies
(POST /api/v1/alerts, POST /api/v1/chaos) before it looks at the body.

In order, each refusal answered with the reason and counted in
`mscale_refused_messages_total{where, why}`:

1. `Host` names the address the connection arrived on (its IP literal and port), a loopback
   name when that address is loopback, the listen host, the node's name, or one of
   `http.allowed_hosts`; an `Origin`, when sent, names the same (403, why="host" / "origin").
   A page in a browser on the node (DNS rebinding, a cross-site form) cannot pass.
2. The endpoint's bearer token, compared in constant time; none configured refuses every call
   (401, why="unauthorised").
3. `Content-Type: application/json` (415, why="content_type"): a browser cannot send it
   cross-site without a preflight the agent never answers.
4. The body: at most the endpoint's byte limit (413, why="oversized"), within
   `http.body_timeout_s` (408, why="timeout"), UTF-8 JSON without NaN/Infinity, integers
   of at most 4300 digits, nested at most MAX_JSON_DEPTH deep (400, why="malformed").

A refused request changes nothing. Log lines about refusals are rate-limited per (where, why).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from mscale.daemon import keys

log = structlog.get_logger("mscale.http")

MAX_JSON_DEPTH = 32
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


class Refused(Exception):
    """A request refused: HTTP status, the counter's `why`, and the reason sent back."""

    def __init__(self, status: int, why: str, reason: str) -> None:
        super().__init__(reason)
        self.status, self.why, self.reason = status, why, reason


class RateLimitedLog:
    """At most one log line per key every `interval_s`; the next line says how many were
    suppressed meanwhile. Refusals can come by the thousand; the journal must not."""

    def __init__(self, interval_s: float = 10.0, clock: Any = time.monotonic) -> None:
        self.interval_s, self.clock = interval_s, clock
        self._last: dict[Any, float] = {}
        self._suppressed: dict[Any, int] = {}

    def warning(self, key: Any, event: str, **fields: Any) -> bool:
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        if len(self._last) > 4096:  # keys are (where, why) pairs; bound it anyway
            self._last.clear()
            self._suppressed.clear()
        self._last[key] = now
        log.warning(event, suppressed=self._suppressed.pop(key, 0), **fields)
        return True


@dataclass
class Access:
    """The names a state-changing request may put in Host/Origin, fixed when the app is made."""

    names: frozenset[str]  # host names accepted on any local address (node name, listen host, allowed)
    with_port: frozenset[str]  # NAME:PORT entries of http.allowed_hosts
    body_timeout_s: float
    logger: RateLimitedLog = field(default_factory=RateLimitedLog)


ACCESS = web.AppKey("access", Access)


def setup(app: web.Application) -> None:
    cfg = app[keys.CONFIG]
    names = {cfg.agent.node.lower(), socket.gethostname().lower(), app[keys.STATE].node.lower()}
    listen_host = cfg.agent.listen.rpartition(":")[0].strip("[]").lower()
    if listen_host and not _is_ip(listen_host) and listen_host not in ("0.0.0.0", "::"):
        names.add(listen_host)
    plain = {h.lower() for h in cfg.http.allowed_hosts if not _split_host(h.lower())[1]}
    ported = {h.lower() for h in cfg.http.allowed_hosts} - plain
    app[ACCESS] = Access(
        names=frozenset(n.rstrip(".") for n in names | plain if n),
        with_port=frozenset(ported),
        body_timeout_s=cfg.http.body_timeout_s,
    )


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _split_host(value: str) -> tuple[str, int | None]:
    """'name:port', '[v6]:port', 'name' -> (name, port or None); ValueError if malformed."""
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise ValueError("unclosed [")
        host, rest = value[1:end], value[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError("junk after ]")
        port_text = rest[1:] if rest else ""
    else:
        host, sep, port_text = value.rpartition(":")
        if not sep:
            host, port_text = value, ""
    if port_text and not (port_text.isascii() and port_text.isdigit() and len(port_text) <= 5):
        raise ValueError(f"port {port_text!r}")
    return host, int(port_text) if port_text else None


def _host_ok(access: Access, value: str, local: Any) -> bool:
    """Whether a Host value (NAME[:PORT]) names the local address `local` (sockname)."""
    if not value or len(value) > 300 or not value.isascii() or any(c.isspace() or c in "/@?#\\" for c in value):
        return False
    value = value.lower()
    try:
        name, port = _split_host(value)
    except ValueError:
        return False
    if not isinstance(local, tuple) or len(local) < 2:
        return False
    local_ip, local_port = str(local[0]).split("%")[0], int(local[1])
    if value in access.with_port:
        return True
    if (port if port is not None else 80) != local_port:
        return False
    name = name.rstrip(".")
    try:
        local_addr = ipaddress.ip_address(local_ip)
    except ValueError:
        return False
    if _is_ip(name):
        asked = ipaddress.ip_address(name)
        return asked == local_addr or (asked.is_loopback and local_addr.is_loopback)
    if local_addr.is_loopback and name in LOOPBACK_NAMES:
        return True
    return name in access.names


def check_host(request: web.Request) -> None:
    """Refused(403) unless Host (and Origin, when sent) name this agent; see the module doc."""
    access = request.app[ACCESS]
    local = request.transport.get_extra_info("sockname") if request.transport else None
    host = request.headers.get("Host", "")
    if not _host_ok(access, host, local):
        raise Refused(403, "host", f"Host {host[:100]!r} does not name this agent's listen address")
    origin = request.headers.get("Origin")
    if origin is not None:
        scheme, sep, rest = origin.partition("://")
        if scheme.lower() != "http" or not sep or not _host_ok(access, rest, local):
            raise Refused(403, "origin", f"Origin {origin[:100]!r} is not this agent")


def check_bearer(request: web.Request, token: str, what: str) -> None:
    """Refused(401) unless `Authorization: Bearer <token>`; an empty token refuses every call."""
    if not token:
        raise Refused(401, "unauthorised", f"no {what} token configured")
    got = request.headers.get("Authorization", "")
    scheme, _, presented = got.partition(" ")
    if scheme.lower() != "bearer" or not presented.strip():
        raise Refused(401, "unauthorised", "missing bearer token")
    try:
        presented_bytes = presented.strip().encode("ascii")
    except UnicodeEncodeError:  # a token is ASCII; the header is not: wrong, and said so
        raise Refused(401, "unauthorised", "wrong bearer token (not ASCII)") from None
    if not hmac.compare_digest(presented_bytes, token.encode()):
        raise Refused(401, "unauthorised", "wrong bearer token")


def check_json_content_type(request: web.Request) -> None:
    if request.content_type != "application/json":
        raise Refused(415, "content_type", f"Content-Type: expected application/json, got {request.content_type!r}")
    charset = request.charset
    if charset is not None and charset.lower() not in ("utf-8", "utf8"):
        raise Refused(415, "content_type", f"charset: expected utf-8, got {charset[:40]!r}")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list):
            deepest = max(deepest, d + 1)
            stack.extend((x, d + 1) for x in v if isinstance(x, (dict, list)))
    return deepest


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Python, not dict itself: the decoder runs bytecode per object, so a thread decoding a
    # large body hands the GIL back to the event loop every switch interval
    return dict(pairs)


def parse_json(raw: bytes, *, in_thread: bool = False) -> Any:
    """UTF-8 JSON, finite numbers, at most MAX_JSON_DEPTH deep; Refused(400) says why not.
    `in_thread`: decoding off the event loop, let the loop's thread run meanwhile."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Refused(400, "malformed", f"body is not UTF-8: {e}") from None
    try:
        value = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=_pairs if in_thread else None)
    except RecursionError:
        raise Refused(400, "malformed", f"body is not JSON: nested deeper than {MAX_JSON_DEPTH}") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, an integer of more than 4300 digits
        raise Refused(400, "malformed", f"body is not JSON: {str(e)[:200]}") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise Refused(400, "malformed", f"body is not JSON: nested deeper than {MAX_JSON_DEPTH}")
    return value


async def read_body(request: web.Request, max_bytes: int) -> bytes:
    """The body, at most `max_bytes`, within http.body_timeout_s; Refused(413/408/400) if not."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise Refused(413, "oversized", f"body of {request.content_length} bytes is over the limit of {max_bytes}")

    async def read() -> bytes:
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = await request.content.read(65536)
            if not chunk:
                return b"".join(chunks)
            total += len(chunk)
            if total > max_bytes:
                raise Refused(413, "oversized", f"body over the limit of {max_bytes} bytes")
            chunks.append(chunk)

    try:
        async with asyncio.timeout(request.app[ACCESS].body_timeout_s):
            return await read()
    except TimeoutError:
        raise Refused(408, "timeout", "the body did not arrive in time") from None
    except HttpProcessingError as e:  # a truncated or malformed chunked body
        raise Refused(400, "malformed", f"body: {e.message}") from None


async def json_post(request: web.Request, *, token: str, what: str, max_bytes: int) -> Any:
    """Every rule above, in order; the parsed body, or Refused."""
    return parse_json(await checked_body(request, token=token, what=what, max_bytes=max_bytes))


async def checked_body(request: web.Request, *, token: str, what: str, max_bytes: int) -> bytes:
    """Every rule above but the JSON's, in order; the raw body, or Refused. For a caller that
    parses it elsewhere (the webhook, off the event loop)."""
    check_host(request)
    check_bearer(request, token, what)
    check_json_content_type(request)
    return await read_body(request, max_bytes)


def refuse(request: web.Request, where: str, refused: Refused) -> web.Response:
    """Count the refusal, log it (rate-limited), answer it as JSON."""
    request.app[keys.STATE].refused[(where, refused.why)] += 1
    request.app[ACCESS].logger.warning(
        (where, refused.why), f"{where}_refused", why=refused.why, reason=refused.reason, peer=request.remote
    )
    return web.json_response({"error": refused.reason}, status=refused.status)
