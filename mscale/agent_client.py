"""The one HTTP client of the node agent's API: `mscale status`, `mscale chaos`, the demo.

SHARED: standard library only (urllib), so a CLI or a training process can talk to the agent
without aiohttp. Every call has a timeout; a failure raises `AgentError` naming the agent's
address, the request and why.

    client = AgentClient()                     # http://127.0.0.1:9477 (mscale.link.DEFAULT_URL)
    client.status(events=10)                   # GET /api/v1/status
    code, reply = client.chaos({"kind": "nan_loss"})
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from mscale.link import DEFAULT_URL


class AgentError(Exception):
    """The agent could not be asked, or answered with an error. The message names its URL."""


class AgentClient:
    """Talks to one agent at `url` ("http://HOST:PORT"; a bare "HOST:PORT" is taken as http)."""

    def __init__(self, url: str = DEFAULT_URL, *, timeout: float = 10.0, chaos_token: str = "") -> None:
        if timeout <= 0:
            raise ValueError(f"timeout: expected seconds > 0, got {timeout!r}")
        url = url.strip().rstrip("/")
        self.url = url if "://" in url else f"http://{url}"
        self.timeout = timeout
        self.chaos_token = chaos_token  # the agent's chaos.token, sent by chaos()

    def __repr__(self) -> str:
        return f"AgentClient({self.url!r}, timeout={self.timeout:g})"

    # --- the API ---------------------------------------------------------------------------

    def status(self, events: int = 10) -> dict:
        """GET /api/v1/status: GPUs, jobs, MPUs, health, fuse levels and the last `events`."""
        return self.get_json(f"/api/v1/status?events={int(events)}")

    def events(self, since: int = 0, limit: int = 10000) -> list[dict]:
        """GET /api/v1/events: the event log from sequence number `since`."""
        return self.get_json(f"/api/v1/events?since={int(since)}&limit={int(limit)}")["events"]

    def metrics(self) -> str:
        """GET /metrics: the Prometheus text page."""
        return self.get_text("/metrics")

    def chaos(self, body: dict) -> tuple[int, dict]:
        """POST /api/v1/chaos with the chaos token (the agent takes it from loopback peers only,
        and only with chaos on: --simulate or chaos.enabled): (HTTP status, reply)."""
        return self.post_json("/api/v1/chaos", body, token=self.chaos_token or None)

    # --- requests ----------------------------------------------------------------------------

    def get(self, path: str, *, timeout: float | None = None) -> bytes:
        """The body of GET `path`; AgentError unless the agent answers 2xx."""
        status, body = self._request("GET", path, None, {}, timeout)
        if not 200 <= status < 300:
            raise AgentError(f"the agent at {self.url} answered GET {path} with HTTP {status}: {_text(body)}")
        return body

    def get_text(self, path: str, *, timeout: float | None = None) -> str:
        return self.get(path, timeout=timeout).decode("utf-8", "replace")

    def get_json(self, path: str, *, timeout: float | None = None) -> Any:
        return self._json("GET", path, self.get(path, timeout=timeout))

    def post_json(
        self, path: str, body: Any, *, token: str | None = None, timeout: float | None = None
    ) -> tuple[int, Any]:
        """POST a JSON body (with a bearer token if given): (HTTP status, JSON reply). An HTTP
        error status is returned, not raised, with the agent's reply (or {"error": its text})."""
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        status, raw = self._request("POST", path, json.dumps(body).encode(), headers, timeout)
        if 200 <= status < 300:
            return status, self._json("POST", path, raw)
        try:
            return status, json.loads(raw) if raw else {}
        except ValueError:
            return status, {"error": _text(raw)}

    def _request(
        self, method: str, path: str, data: bytes | None, headers: dict, timeout: float | None
    ) -> tuple[int, bytes]:
        timeout = self.timeout if timeout is None else timeout
        where = f"{method} {path}"
        try:
            req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        except ValueError as e:  # not a URL urllib understands
            raise AgentError(f"cannot reach the agent at {self.url}: {e}") from None
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            with e:
                return e.code, e.read()
        except TimeoutError:
            raise AgentError(f"the agent at {self.url} did not answer {where} within {timeout:g} s") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise AgentError(f"the agent at {self.url} did not answer {where} within {timeout:g} s") from None
            raise AgentError(f"cannot reach the agent at {self.url}: {e.reason}") from None
        except (OSError, ValueError) as e:  # connection reset, a malformed response
            raise AgentError(f"cannot reach the agent at {self.url}: {e}") from None

    def _json(self, method: str, path: str, body: bytes) -> Any:
        try:
            return json.loads(body)
        except ValueError:
            raise AgentError(
                f"the agent at {self.url} answered {method} {path} with something that is not JSON: {_text(body)}"
            ) from None


def _text(body: bytes, limit: int = 200) -> str:
    text = body.decode("utf-8", "replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."
