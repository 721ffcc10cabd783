"""Who may change the agent's state over HTTP (issue 16, items 1 and 8), against a real agent
(in-process, 127.0.0.1, simulated GPUs) over real sockets: the chaos API off by default, its
own bearer token, Host/Origin/content-type rules on the chaos API and the webhook, bounded
bodies and fields, and the webhook's former 500s. Every refusal is counted and changes nothing.
Fuzzed: the JSON body reader, the Host rule, the chaos body (parser and endpoint), the webhook
body (endpoint)."""

from __future__ import annotations

import http.client
import json
import logging
import re

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from mscale.daemon import access, chaos
from mscale.daemon import config as configmod
from mscale.demo.embedded import EmbeddedAgent
from mscale.link import CHAOS_FIELDS, CHAOS_KINDS
from mscale.sim.nvml import SimNvml
from support.fuzz import json_values


@pytest.fixture(scope="module")
def agent():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    with EmbeddedAgent() as a:
        yield a
    structlog.reset_defaults()


def port_of(agent: EmbeddedAgent) -> int:
    return int(agent.url.rsplit(":", 1)[1])


def send(
    agent: EmbeddedAgent,
    path: str,
    body: bytes | None,
    headers: dict,
    *,
    method: str = "POST",
    source: str = "127.0.0.1",
) -> tuple[int, bytes]:
    """One raw request with exactly these headers (Host included), from `source`."""
    conn = http.client.HTTPConnection("127.0.0.1", port_of(agent), timeout=10, source_address=(source, 0))
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def good_headers(agent: EmbeddedAgent, token: str) -> dict:
    return {
        "Host": f"127.0.0.1:{port_of(agent)}",
        "Content-Type": "application/json",
        "Authorization": f"Bearer {token}",
    }


def refused(agent: EmbeddedAgent, where: str, why: str) -> float:
    m = re.search(rf'^mscale_refused_messages_total{{where="{where}",why="{why}"}} (\S+)$', agent.get("/metrics"), re.M)
    return float(m.group(1)) if m else 0.0


def injected(agent: EmbeddedAgent) -> int:
    return len([e for e in agent.events() if e["reason"] == "chaos_injected"])


# --- chaos: off by default, its own token -------------------------------------------------


def test_chaos_is_off_unless_simulated_or_enabled():
    assert configmod.from_dict({}).chaos.enabled is False
    assert not chaos.enabled(configmod.from_dict({}))
    assert chaos.enabled(configmod.from_dict({"agent": {"simulate": "timeline.yaml"}}))
    assert chaos.enabled(configmod.from_dict({"chaos": {"enabled": True}}))


def test_chaos_off_refuses_agent_kill_and_the_agent_lives():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    with EmbeddedAgent(chaos={"enabled": False}) as a:
        before = refused(a, "chaos", "disabled")
        status, reply = a.chaos({"kind": "agent_kill"})
        assert status == 403 and "chaos API is off" in reply["error"]
        status, _ = a.chaos({"kind": "xid", "gpu": 0, "code": 79})
        assert status == 403
        assert refused(a, "chaos", "disabled") == before + 2
        assert a.get("/api/v1/status")["node"] == "sim-node" and injected(a) == 0


def test_chaos_without_a_configured_token_refuses_every_call(monkeypatch):
    monkeypatch.delenv("MSCALE_CHAOS_TOKEN", raising=False)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    with EmbeddedAgent(chaos={"token": ""}) as a:
        assert a.config.chaos.token == ""
        for token in (None, "", "anything"):
            status, reply = a.post("/api/v1/chaos", {"kind": "nan_loss"}, token=token)
            assert status == 401 and "no chaos token configured" in reply["error"]
        assert refused(a, "chaos", "unauthorised") == 3 and injected(a) == 0


def test_chaos_token_is_required_and_compared(agent):
    before, events = refused(agent, "chaos", "unauthorised"), injected(agent)
    status, reply = agent.post("/api/v1/chaos", {"kind": "nan_loss"})
    assert status == 401 and "missing bearer token" in reply["error"]
    status, reply = agent.post("/api/v1/chaos", {"kind": "nan_loss"}, token="not-it")
    assert status == 401 and "wrong bearer token" in reply["error"]
    status, _ = agent.post("/api/v1/chaos", {"kind": "nan_loss"}, token=agent.token)  # the webhook's: not chaos's
    assert status == 401
    headers = good_headers(agent, agent.chaos_token) | {"Authorization": "Bearer t\u00e4ken"}  # not ASCII
    status, raw = send(agent, "/api/v1/chaos", b'{"kind": "nan_loss"}', headers)
    assert status == 401 and b"wrong bearer token" in raw
    assert refused(agent, "chaos", "unauthorised") == before + 4 and injected(agent) == events
    status, reply = agent.chaos({"kind": "nan_loss"})
    assert status == 200 and reply["injected"] == "nan_loss" and injected(agent) == events + 1


def test_chaos_token_from_the_environment(monkeypatch):
    monkeypatch.setenv("MSCALE_CHAOS_TOKEN", "from-env")
    assert configmod.from_dict({}).chaos.token == "from-env"
    assert configmod.from_dict({"chaos": {"token": "file"}}).chaos.token == "file"


# --- Host, Origin, content type: the chaos API and the webhook alike -----------------------

ENDPOINTS = {
    "chaos": ("/api/v1/chaos", lambda a: a.chaos_token, b'{"kind": "nan_loss"}'),
    "webhook": ("/api/v1/alerts", lambda a: a.token, b'{"version": "4", "status": "firing", "alerts": []}'),
}


@pytest.mark.parametrize("where", sorted(ENDPOINTS))
@pytest.mark.parametrize(
    "change,status,why",
    [
        # the request: text/plain, a foreign Host and Origin (a browser on the node)
        (
            lambda p: {"Host": f"evil.example:{p}", "Origin": "http://evil.example", "Content-Type": "text/plain"},
            403,
            "host",
        ),
        (lambda p: {"Host": f"evil.example:{p}"}, 403, "host"),  # DNS rebinding: our port, their name
        (lambda p: {"Host": f"127.0.0.1:{p + 1}"}, 403, "host"),
        (lambda p: {"Host": "127.0.0.1"}, 403, "host"),  # no port: 80, not ours
        (lambda p: {"Host": ""}, 403, "host"),
        (lambda p: {"Host": f"127.0.0.1:{p}", "Origin": "http://evil.example"}, 403, "origin"),
        (lambda p: {"Origin": "null"}, 403, "origin"),
        (lambda p: {"Origin": f"https://127.0.0.1:{p}"}, 403, "origin"),
        (lambda p: {"Content-Type": "text/plain"}, 415, "content_type"),
        (lambda p: {"Content-Type": "application/x-www-form-urlencoded"}, 415, "content_type"),
        (lambda p: {"Content-Type": "application/json; charset=latin-1"}, 415, "content_type"),
    ],
)
def test_state_changing_requests_must_name_this_agent_and_send_json(agent, where, change, status, why):
    path, token, body = ENDPOINTS[where]
    headers = good_headers(agent, token(agent)) | change(port_of(agent))
    before, events = refused(agent, where, why), len(agent.events())
    got, raw = send(agent, path, body, headers)
    assert got == status, raw
    assert refused(agent, where, why) == before + 1
    assert not [e for e in agent.events()[events:] if e["reason"] in ("chaos_injected", "heal_action")]


@pytest.mark.parametrize("where", sorted(ENDPOINTS))
@pytest.mark.parametrize(
    "host,origin",
    [
        ("127.0.0.1:{p}", None),
        ("localhost:{p}", None),
        ("LOCALHOST.:{p}", "http://localhost:{p}"),
        ("127.0.0.1:{p}", "http://127.0.0.1:{p}"),
        ("sim-node:{p}", None),  # the node's name
    ],
)
def test_the_listen_address_and_loopback_names_are_accepted(agent, where, host, origin):
    path, token, body = ENDPOINTS[where]
    p = port_of(agent)
    headers = good_headers(agent, token(agent)) | {"Host": host.format(p=p)}
    if origin:
        headers["Origin"] = origin.format(p=p)
    status, raw = send(agent, path, body, headers)
    assert status == 200, raw


def test_allowed_hosts_extend_the_names():
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    with EmbeddedAgent(http={"allowed_hosts": ["agent.example", "proxy.example:8080"]}) as a:
        p = port_of(a)
        for host, ok in (
            (f"agent.example:{p}", True),
            ("proxy.example:8080", True),
            (f"proxy.example:{p}", False),
            (f"other.example:{p}", False),
        ):
            status, raw = send(
                a, "/api/v1/chaos", b'{"kind": "nan_loss"}', good_headers(a, a.chaos_token) | {"Host": host}
            )
            assert (status == 200) == ok, (host, status, raw)


@pytest.mark.parametrize(
    "hosts,words",
    [(["a b"], "allowed_hosts[0]"), ([""], "allowed_hosts[0]"), (["ok", 3], "allowed_hosts[1]")],
)
def test_bad_allowed_hosts_are_refused_by_the_config(hosts, words):
    with pytest.raises(configmod.ConfigError, match=re.escape(words)):
        configmod.from_dict({"http": {"allowed_hosts": hosts}})


def test_per_peer_cap_above_total_is_refused_by_the_config():
    with pytest.raises(configmod.ConfigError, match="max_connections_per_peer"):
        configmod.from_dict({"http": {"max_connections": 10, "max_connections_per_peer": 20}})


# --- bounded bodies and fields ----------------------------------------------------------


def test_a_1mib_mpu_string_is_refused_and_stored_nowhere(agent):
    events = agent.events()
    size = len(json.dumps(events))
    before = refused(agent, "chaos", "oversized")
    body = json.dumps({"kind": "corrupt", "mpu": "v" * (1 << 20), "mode": "noise"}).encode()
    for _ in range(60):  # the 60 posts
        status, raw = send(agent, "/api/v1/chaos", body, good_headers(agent, agent.chaos_token))
        assert status == 413, raw
    assert refused(agent, "chaos", "oversized") == before + 60
    after = agent.events()
    assert len(after) == len(events) and len(json.dumps(after)) == size


@pytest.mark.parametrize(
    "body,words",
    [
        ('{"kind": "corrupt", "mpu": "%s", "mode": "noise"}' % ("v" * 65), "mpu: expected an MPU id or name"),
        ('{"kind": "corrupt", "mpu": "vision\\n", "mode": "noise"}', "mpu"),
        ('{"kind": "corrupt", "mpu": "\\u001b[2J", "mode": "noise"}', "mpu"),
        ('{"kind": "nan_loss", "job_id": "%s"}' % ("j" * 129), "job_id"),
        ('{"kind": "nan_loss", "job_id": "job\\n"}', "job_id"),
        ('{"kind": "nan_loss", "mpu": ["x", "x", "x"]}', "mpu"),  # a field the kind ignores is checked too
        ('{"kind": "nan_loss", "code": 1e400}', "code"),
        ('{"kind": "hang", "seconds": 1e400}', "seconds"),
        ('{"kind": "steps", "steps": %s}' % ("9" * 400), "kind"),
        ('{"kind": "loss_spike", "factor": NaN}', "not JSON"),  # NaN is no JSON number
    ],
)
def test_chaos_fields_are_bounded(agent, body, words):
    before = injected(agent)
    status, reply = send(agent, "/api/v1/chaos", body.encode(), good_headers(agent, agent.chaos_token))
    assert status == 400 and words in json.loads(reply)["error"], reply
    assert injected(agent) == before


# --- the webhook's former 500s (item 8) ---------------------------------------------------


def test_non_ascii_authorization_is_401_not_500(agent):
    before = refused(agent, "webhook", "unauthorised")
    headers = good_headers(agent, agent.token) | {"Authorization": "Bearer \u00e9t\u00e9"}
    status, raw = send(agent, "/api/v1/alerts", b'{"version": "4", "status": "firing", "alerts": []}', headers)
    assert status == 401 and b"bearer token" in raw
    headers["Authorization"] = b"Bearer \xff\xfe\xc3"  # not even UTF-8
    status, raw = send(agent, "/api/v1/alerts", b"{}", headers)
    assert status == 401
    assert refused(agent, "webhook", "unauthorised") == before + 2


@pytest.mark.parametrize(
    "body,words",
    [
        (b'{"version": "4", "status": "firing", "alerts": [], "n": ' + b"7" * 5000 + b"}", b"not JSON"),
        (b"[" * 1000 + b"]" * 1000, b"nested deeper than"),
        (b'{"a": ' * 100 + b"1" + b"}" * 100, b"nested deeper than"),
        (b'{"version": "4", "x": NaN}', b"not JSON"),
        (b'{"version": "4", "x": Infinity}', b"not JSON"),
        ('{"version": "4", "x": "\u00e9"}'.encode("latin-1"), b"not UTF-8"),
        (b'{"version": "4", "status": "firing", "alerts": 1e400}', b"alerts: expected a list"),
    ],
)
def test_webhook_inputs_that_answered_500_now_get_400(agent, body, words):
    before = refused(agent, "webhook", "malformed")
    status, raw = send(agent, "/api/v1/alerts", body, good_headers(agent, agent.token))
    assert status == 400 and words in raw, raw
    assert refused(agent, "webhook", "malformed") == before + 1


def test_webhook_body_over_the_limit_is_413_and_counted(agent):
    before = refused(agent, "webhook", "oversized")
    body = b'{"pad": "' + b"x" * (agent.config.webhook.max_body_bytes + 10) + b'"}'
    status, _ = send(agent, "/api/v1/alerts", body, good_headers(agent, agent.token))
    assert status == 413 and refused(agent, "webhook", "oversized") == before + 1


# --- fuzz ---------------------------------------------------------------------------------

JSON = json_values(infinity=True, max_text=20, max_leaves=20)


@given(st.binary(max_size=300) | JSON.map(lambda v: json.dumps(v).encode()))
def test_fuzz_parse_json_gives_a_value_or_a_400(raw):
    try:
        value = access.parse_json(raw)
    except access.Refused as e:
        assert e.status == 400 and e.why == "malformed" and e.reason
    else:
        assert access.json_depth(value) <= access.MAX_JSON_DEPTH


@given(st.integers(min_value=1, max_value=200))
def test_fuzz_json_depth_limit(depth):
    raw = b"[" * depth + b"]" * depth
    if depth <= access.MAX_JSON_DEPTH:
        assert access.json_depth(access.parse_json(raw)) == depth
    else:
        with pytest.raises(access.Refused, match="nested deeper"):
            access.parse_json(raw)


@given(st.text(max_size=60), st.sampled_from([("127.0.0.1", 9477), ("::1", 9477, 0, 0), ("10.0.0.7", 80), None]))
def test_fuzz_host_rule_answers_a_bool(value, local):
    acc = access.Access(names=frozenset({"node1"}), with_port=frozenset({"proxy:8080"}), body_timeout_s=1)
    ok = access._host_ok(acc, value, local)
    assert isinstance(ok, bool)
    if ok and value.lower() != "proxy:8080":
        assert local is not None and value.isascii()


CHAOS_BODY = st.fixed_dictionaries(
    {"kind": st.sampled_from([k for k in CHAOS_KINDS if k != "agent_kill"] + ["meteor", ""]) | JSON},
    optional={
        f: JSON | st.integers(-5, 2000) | st.sampled_from(["vision", "001", "noise", "nan", "none", "job-1"])
        for f in CHAOS_FIELDS
        if f != "kind"
    },
) | st.dictionaries(st.text(max_size=10), JSON, max_size=4)


@given(CHAOS_BODY)
def test_fuzz_chaos_parser_refuses_or_builds_a_bounded_command(body):
    nvml = SimNvml(8)
    try:
        kind, cmd, event = chaos.command_for(body, nvml)
    except chaos.ChaosError as e:
        assert str(e)
        return
    assert kind == body["kind"] and kind in CHAOS_KINDS
    assert set(body) <= set(CHAOS_FIELDS)
    for v in body.values():  # every field the event will carry is short
        assert len(str(v)) <= 128 and not isinstance(v, (list, dict))
    assert isinstance(cmd, dict) and (event is None or kind in ("xid", "ecc"))


@given(CHAOS_BODY)
def test_fuzz_chaos_endpoint_answers_200_or_400_and_refusals_change_nothing(agent, body):
    if body.get("kind") == "agent_kill":
        return
    before = injected(agent)
    status, reply = agent.chaos(body)
    assert status in (200, 400), reply
    assert injected(agent) == before + (status == 200)


WEBHOOK_BODY = (
    st.fixed_dictionaries(
        {
            "version": st.sampled_from(["4", "3", 4]),
            "status": st.sampled_from(["firing", "resolved", "pending"]),
            "alerts": st.lists(
                st.fixed_dictionaries(
                    {
                        "status": st.sampled_from(["firing", "resolved"]) | JSON,
                        "labels": st.dictionaries(
                            st.sampled_from(["alertname", "fuzz", "severity"]), st.text(max_size=8)
                        )
                        | JSON,
                    },
                    optional={"fingerprint": JSON, "startsAt": JSON, "annotations": JSON},
                ),
                max_size=3,
            )
            | JSON,
        }
    )
    | JSON
)


@given(WEBHOOK_BODY)
def test_fuzz_webhook_endpoint_answers_200_or_400_and_refusals_change_nothing(agent, body):
    n = len(agent.events())
    status, reply = agent.post("/api/v1/alerts", body, token=agent.token)
    assert status in (200, 400), reply
    if status == 400:
        assert "error" in reply
        assert not [e for e in agent.events()[n:] if e["source"] in ("webhook", "healing")]
