"""Fault timelines: the format, durations, and malformed files refused with the line at fault
(directly and through the real `mscale agent` CLI, exit status 2)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib import resources

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mscale.sim.timeline import TimelineError, event_from_dict, load_timeline, parse_duration, parse_timeline

ISSUE_EXAMPLE = """\
gpus: 8                 # default 8
events:
  - at: 2s              # seconds after start; "500ms" and "1m" also accepted
    gpu: 3              # index
    fault: xid
    code: 79            # for xid
  - {at: 5s, gpu: 1, fault: temperature, celsius: 88, ramp: 3s}
  - {at: 6s, gpu: 2, fault: ecc_sbe_storm, per_hour: 500}
  - {at: 7s, gpu: 4, fault: nvlink_down, link: 2}
  - {at: 9s, gpu: 1, fault: recover}
"""


def test_issue_example_parses() -> None:
    tl = parse_timeline(ISSUE_EXAMPLE)
    assert tl.gpus == 8
    assert [(e.at_s, e.gpu, e.fault) for e in tl.events] == [
        (2.0, 3, "xid"),
        (5.0, 1, "temperature"),
        (6.0, 2, "ecc_sbe_storm"),
        (7.0, 4, "nvlink_down"),
        (9.0, 1, "recover"),
    ]
    xid, temp, sbe, link, _ = tl.events
    assert xid.code == 79 and xid.line == 3
    assert temp.celsius == 88 and temp.ramp_s == 3.0
    assert sbe.per_hour == 500
    assert link.link == 2


@pytest.mark.parametrize(
    "text,seconds",
    [("2s", 2.0), ("500ms", 0.5), ("1m", 60.0), ("1.5s", 1.5), ("1h", 3600.0), (3, 3.0), (0.25, 0.25), ("7", 7.0)],
)
def test_durations(text, seconds) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["2 sec", "-1s", "soon", -3, True, None, "1d"])
def test_bad_durations(bad) -> None:
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_defaults_and_empty() -> None:
    assert parse_timeline("").gpus == 8
    tl = parse_timeline("events:\n")
    assert tl.gpus == 8 and tl.events == ()
    assert parse_timeline("gpus: 2\nmodel: h200\n").model == "h200"


def test_events_sorted_by_time_keeping_file_order_for_ties() -> None:
    tl = parse_timeline(
        "events:\n  - {at: 3s, gpu: 0, fault: gpu_lost}\n  - {at: 1s, gpu: 1, fault: recover}\n"
        "  - {at: 3s, gpu: 0, fault: recover}\n"
    )
    assert [(e.at_s, e.fault) for e in tl.events] == [(1.0, "recover"), (3.0, "gpu_lost"), (3.0, "recover")]


BAD = [
    # (text, line at fault, words the message must contain)
    ("gpus: 8\nevents:\n  - {at: 2s, gpu: 3, fault: xid}\n", 3, ["events[0].code", "missing"]),
    ("gpus: 8\nevents:\n  - at: 2s\n    gpu: 9\n    fault: recover\n", 4, ["events[0].gpu", "0..7"]),
    (
        "events:\n  - {at: 1s, gpu: 0, fault: recover}\n  - {at: 2x, gpu: 0, fault: recover}\n",
        3,
        ["events[1].at", "duration"],
    ),
    ("events:\n  - {at: 1s, gpu: 0, fault: meltdown}\n", 2, ["events[0].fault", "xid | ecc_dbe".split(" | ")[0]]),
    ("events:\n  - {at: 1s, gpu: 0, fault: xid, code: 79, colour: red}\n", 2, ["events[0].colour", "unknown key"]),
    ("events:\n  - at: 1s\n    gpu: 0\n    fault: temperature\n    celsius: hot\n", 5, ["events[0].celsius", "number"]),
    ("events:\n  - {at: 1s, gpu: 0, fault: nvlink_down, link: 40}\n", 2, ["events[0].link", "0..17"]),
    ("gpus: 8\ncolour: red\n", 2, ["colour", "unknown key"]),
    ("gpus: lots\n", 1, ["gpus", "integer"]),
    ("gpus: 8\nevents:\n  - {at: 1s, gpu: 0\n", 4, ["not valid YAML"]),
    ("gpus: 8\nevents: 3\n", 2, ["events", "list"]),
    ("gpus: 8\nevents:\n  - 5\n", 3, ["events[0]", "mapping"]),
    ("- 1\n- 2\n", 1, ["expected a mapping"]),
    ("model: a100\n", 1, ["model", "h100"]),
    ("events:\n  - {at: 1s, gpu: 0, fault: xid, code: 79, recovery_action: 2}\n", 2, ["recovery_action", "154"]),
    ("events:\n  - {at: 1s, gpu: 0, fault: xid, code: 154, recovery_action: 7}\n", 2, ["recovery_action", "0..4"]),
]


@pytest.mark.parametrize("text,line,words", BAD)
def test_malformed_timelines_name_the_line(text, line, words) -> None:
    with pytest.raises(TimelineError) as err:
        parse_timeline(text, "t.yaml")
    msg = str(err.value)
    assert msg.startswith(f"t.yaml line {line}"), msg
    for w in words:
        assert w in msg, msg


def test_event_from_dict_for_chaos() -> None:
    ev = event_from_dict({"gpu": 2, "fault": "xid", "code": 48}, gpus=8)
    assert (ev.gpu, ev.fault, ev.code, ev.at_s) == (2, "xid", 48, 0.0)
    with pytest.raises(TimelineError, match=r"event\.gpu"):
        event_from_dict({"gpu": 8, "fault": "recover"}, gpus=8)
    with pytest.raises(TimelineError, match="mapping"):
        event_from_dict(["xid"], gpus=8)


def test_shipped_timelines_parse() -> None:
    folder = resources.files("mscale.sim") / "timelines"
    names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".yaml"))
    assert "default.yaml" in names and "xid79_gpu3.yaml" in names
    for name in names:
        assert load_timeline(str(folder / name)).events
    must = load_timeline(str(folder / "xid79_gpu3.yaml")).events
    assert [(e.at_s, e.gpu, e.fault, e.code) for e in must] == [(2.0, 3, "xid", 79)]


def test_missing_file() -> None:
    with pytest.raises(TimelineError, match="cannot read"):
        load_timeline("/nonexistent/timeline.yaml")


@pytest.mark.parametrize(
    "text,line,word",
    [
        ("gpus: 8\nevents:\n  - {at: 2s, gpu: 3, fault: xid}\n", 3, "events[0].code"),
        ("gpus: 8\nevents:\n  - {at: 1s, gpu: 0\n", 4, "not valid YAML"),
    ],
)
def test_agent_refuses_bad_timeline_with_exit_2(tmp_path, text, line, word) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mscale",
            "agent",
            "--simulate",
            str(path),
            "--listen",
            "127.0.0.1:0",
            "--socket",
            str(tmp_path / "a.sock"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"line {line}" in proc.stderr and word in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_agent_refuses_bad_xid_table_with_exit_2(tmp_path) -> None:
    table = tmp_path / "xids.csv"
    table.write_text(
        textwrap.dedent("""\
        code,class,description
        79,fatal,GPU has fallen off the bus
        48,catastrophic,Double-bit ECC error
        """)
    )
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[health]\nxid_table = "{table}"\n')
    timeline = resources.files("mscale.sim") / "timelines" / "xid79_gpu3.yaml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mscale",
            "agent",
            "--config",
            str(cfg),
            "--simulate",
            str(timeline),
            "--listen",
            "127.0.0.1:0",
            "--socket",
            str(tmp_path / "a.sock"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "line 3" in proc.stderr and "class" in proc.stderr and "catastrophic" in proc.stderr, proc.stderr


def test_an_event_at_zero_is_kept_and_its_xid_heard_by_a_later_listener() -> None:
    """`at: 0s` is due at once: the first NVML call applies it, before anyone waits for Xid
    events; the first event source still gets it, once (a second source does not)."""
    from mscale.sim.nvml import SimNvml

    tl = parse_timeline("events:\n  - {at: 0s, gpu: 1, fault: xid, code: 79}\n  - {at: 0, gpu: 2, fault: gpu_lost}\n")
    assert [(e.at_s, e.gpu, e.fault) for e in tl.events] == [(0.0, 1, "xid"), (0.0, 2, "gpu_lost")]
    sim = SimNvml.from_timeline(tl, clock=lambda: 100.0)
    assert sim.recovery_action(1) == 1  # applied by this first call (a fatal Xid asks for a reset)
    first = sim.xid_events()
    ev = first.wait(0)
    assert ev is not None and (ev.gpu, ev.xid) == (1, 79) and first.wait(0) is None
    assert sim.xid_events().wait(0) is None
    assert [e.fault for _, e in sim.applied] == ["xid", "gpu_lost"]
    sim.close()


# --- issue 16 item 8: inputs that ended in tracebacks; fuzzing ------------------------------

ISSUE_16 = [
    # (text, line at fault, words the message must contain)
    ("events:\n  - at: " + "9" * 300 + "\n    gpu: 0\n    fault: gpu_lost\n", 2, ["events[0].at", "duration", "..."]),
    ("events:\n  - {at: " + "9" * 400 + ", gpu: 0, fault: gpu_lost}\n", 2, ["events[0].at"]),
    ("events:\n  - {at: '" + "9" * 400 + "s', gpu: 0, fault: gpu_lost}\n", 2, ["events[0].at"]),
    ("events:\n  - {at: .nan, gpu: 0, fault: gpu_lost}\n", 2, ["events[0].at", "nan"]),
    ("events:\n  - {at: .inf, gpu: 0, fault: gpu_lost}\n", 2, ["events[0].at", "inf"]),
    ("events:\n  - {at: 1s, gpu: 0, fault: temperature, celsius: .nan}\n", 2, ["events[0].celsius"]),
    ("events:\n  - {at: 1s, gpu: 0, fault: temperature, celsius: 50, ramp: 1e400}\n", 2, ["events[0].ramp"]),
    ("events:\n  - ? [a, b]\n    : 1\n    gpu: 0\n    fault: gpu_lost\n", 2, ["events[0]", "plain names"]),
    ("? {a: 1}\n: 2\n", 1, ["keys must be plain names"]),
    ("events:\n  - {at: 1s, gpu: 0, fault: [xid]}\n", 2, ["events[0].fault", "['xid']"]),
    ("events:\n  - {at: 1s, gpu: 0, fault: {a: 1}}\n", 2, ["events[0].fault"]),
    ("events:\n  - {at: 2001-13-45, gpu: 0, fault: gpu_lost}\n", 2, ["events[0].at", "not a valid value"]),
    ("gpus: !!int eight\n", 1, ["gpus", "not a valid value"]),
    ("events:\n  - {1: 2, gpu: 0, fault: gpu_lost}\n", 2, ["events[0]", "plain names"]),
    ("model: [h100]\n", 1, ["model", "h100"]),
    ("gpus: 2\n# \x00\n", 2, ["not valid YAML", "#x0000"]),
]


@pytest.mark.parametrize("text,line,words", ISSUE_16)
def test_issue_16_timelines_refused_with_file_line_and_key(text, line, words) -> None:
    with pytest.raises(TimelineError) as err:
        parse_timeline(text, "t.yaml")
    msg = str(err.value)
    assert msg.startswith(f"t.yaml line {line}:"), msg
    assert len(msg) < 400, msg  # a 400-digit value is cut, not echoed whole
    for w in words:
        assert w in msg, msg


def test_deeply_nested_timeline_is_refused() -> None:
    with pytest.raises(TimelineError, match=r"^t\.yaml: not valid YAML: nested too deeply"):
        parse_timeline("events: " + "[" * 5000 + "]" * 5000, "t.yaml")


def test_not_utf8_timeline_names_file_and_line(tmp_path) -> None:
    path = tmp_path / "t.yaml"
    path.write_bytes(b"gpus: 2\nevents:\n  - {at: 1s, gpu: 0, fault: gpu_lost} # caf\xe9\n")
    with pytest.raises(TimelineError, match=rf"^{path} line 3: not UTF-8 text \(byte 0xe9 at column 44\)"):
        load_timeline(path)


@pytest.mark.parametrize(
    "bad", [float("nan"), float("inf"), 10**400, "9" * 400 + "s", 366 * 86400 + 1, "1e3s", "٣s"], ids=repr
)
def test_bad_durations_issue_16(bad) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)


def test_chaos_event_with_a_list_fault_is_refused() -> None:
    with pytest.raises(TimelineError, match=r"event\.fault"):
        event_from_dict({"gpu": 0, "fault": ["xid"]}, gpus=8)


_VALUES = [
    "2s", "0", "-1", ".nan", ".inf", "1e400", "9" * 300, "'9" + "9" * 300 + "s'", "2001-13-45", "!!int x",
    "!!float y", "!!binary '@'", "[a, b]", "{a: 1}", "~", "''", "xid", "temperature", "recover", "79", "3",
    "&a [*a]", "*nope", "!!python/object:os.system x", "'²'", "h200", "true",
]  # fmt: skip
_KEYS = ["at", "gpu", "fault", "code", "count", "per_hour", "celsius", "ramp", "link", "per_min", "colour", "[k]", "1"]


def _timeline_text() -> st.SearchStrategy[str]:
    pair = st.tuples(st.sampled_from(_KEYS), st.sampled_from(_VALUES) | st.text(max_size=6))
    event = st.lists(pair, max_size=6).map(lambda kvs: "  - " + "\n    ".join(f"{k}: {v}" for k, v in kvs))
    top = st.tuples(
        st.sampled_from(["", "gpus: 4\n", "gpus: .nan\n", "model: h200\n", "colour: 1\n"]),
        st.lists(event, max_size=4),
        st.text(max_size=10),
    )
    return top.map(lambda t: t[0] + "events:\n" + "\n".join(t[1]) + "\n" + t[2])


@given(text=_timeline_text() | st.text(max_size=60))
def test_fuzzed_timeline_is_a_timeline_or_a_clear_refusal(text) -> None:
    try:
        tl = parse_timeline(text, "t.yaml")
    except TimelineError as e:
        msg = str(e)
        assert msg.startswith("t.yaml line ") or msg.startswith("t.yaml: not valid YAML"), msg
    else:
        assert 1 <= tl.gpus <= 64 and tl.model in ("h100", "h200")
        for ev in tl.events:
            assert 0 <= ev.at_s <= 366 * 86400 and 0 <= ev.gpu < tl.gpus and isinstance(ev.fault, str)


@given(
    data=st.dictionaries(
        st.sampled_from(_KEYS),
        st.none() | st.integers() | st.floats() | st.text(max_size=5) | st.lists(st.integers(), max_size=2),
        max_size=6,
    )
)
def test_fuzzed_chaos_event_is_an_event_or_a_clear_refusal(data) -> None:
    try:
        ev = event_from_dict(data, gpus=8)
    except TimelineError as e:
        assert str(e).startswith("event."), str(e)
    else:
        assert 0 <= ev.at_s <= 366 * 86400 and 0 <= ev.gpu < 8
