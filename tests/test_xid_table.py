"""The Xid table parser (issue 16 item 8): a malformed line, odd digits or bytes that are not
UTF-8 are refused with XidTableError naming the file and line, never another exception."""

from __future__ import annotations

from importlib import resources

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mscale.daemon.config import from_dict
from mscale.probes.gpu_health import XID_CLASSES, HealthModel, XidTableError, load_xid_table, parse_xid_table
from mscale.probes.gpu_sample import GpuSample

HEADER = "code,class,description\n"


@pytest.mark.parametrize(
    "body,line,words",
    [
        (HEADER + "²,fatal,superscript two\n", 2, ["code", "'²'"]),  # issue 16: exit 2 without a line
        (HEADER + "٣,fatal,arabic-indic three\n", 2, ["code"]),
        (HEADER + "1_0,fatal,underscore\n", 2, ["code"]),
        (HEADER + "9" * 5000 + ",fatal,huge\n", 2, ["code"]),
        (HEADER + "0,fatal,zero\n", 2, ["code"]),
        (HEADER + "65536,fatal,too big\n", 2, ["code"]),
        (HEADER + '79,fatal,"unterminated\n', 2, ["not a CSV row"]),
        (HEADER + '79,fatal,"a"b\n', 2, ["not a CSV row"]),
        (HEADER + "79,fatal,a\rb\n", 2, ["not one CSV row"]),
        (HEADER + "\x0b\n79,info,x\n80,weird,y\n", 4, ["class", "'weird'"]),  # lines as an editor counts
    ],
)
def test_bad_xid_lines_name_file_and_line(body, line, words) -> None:
    with pytest.raises(XidTableError) as err:
        parse_xid_table(body, "x.csv")
    msg = str(err.value)
    assert msg.startswith(f"x.csv line {line}:"), msg
    assert len(msg) < 300, msg
    for w in words:
        assert w in msg, msg


def test_not_utf8_xid_table_names_file_and_line(tmp_path) -> None:
    path = tmp_path / "x.csv"
    path.write_bytes(HEADER.encode() + b"79,fatal,ok\n48,fatal,\x80\n")
    with pytest.raises(XidTableError, match=rf"^{path} line 3: not UTF-8 text \(byte 0x80 at column 10\)"):
        load_xid_table(str(path))


def test_crlf_table_parses() -> None:
    assert parse_xid_table("code,class,description\r\n79,fatal,off the bus\r\n").classify(79).cls == "fatal"


_SHIPPED = resources.files("mscale.probes").joinpath("xid_table.csv").read_text().split("\n")
_JUNK = ["²,fatal,x", "79,fatal,dup", "1,loud,x", "2,info", '3,info,"q', "4,info,", "code,class,description", "#c", ""]


@given(
    edits=st.lists(
        st.tuples(st.integers(0, len(_SHIPPED)), st.booleans(), st.sampled_from(_JUNK) | st.text(max_size=16)),
        max_size=4,
    )
)
def test_fuzzed_xid_table_is_a_table_or_a_clear_refusal(edits) -> None:
    lines = list(_SHIPPED)
    for at, insert, junk in edits:
        at = min(at, len(lines))
        if insert or at == len(lines):
            lines.insert(at, junk)
        else:
            lines[at] = junk
    try:
        table = parse_xid_table("\n".join(lines), "x.csv")
    except XidTableError as e:
        msg = str(e)
        assert msg.startswith("x.csv line ") or msg.startswith("x.csv: empty table"), msg
    else:
        for code, info in table.entries.items():
            assert 1 <= code <= 65535 and info.cls in XID_CLASSES and info.description


def test_without_a_recovery_action_a_fatal_xid_lapses_after_its_hold() -> None:
    """A driver without NVML's recovery-action field and a reset that left no counter to show
    it: the fatal Xid clears health.xid_fatal_hold_s after it last occurred (docs/xid.md)."""
    model = HealthModel(from_dict({"health": {"xid_fatal_hold_s": 600}}).health)
    plain = GpuSample(index=0, uuid="GPU-x", recovery_action=None, ecc_sbe_volatile=0)
    model.observe_xid(0, 48, 1000.0)
    assert model.update(0, plain, 1000.0).health.state == "failed"
    assert model.update(0, plain, 1599.0).health.state == "failed"
    model.observe_xid(0, 48, 1599.0)  # it recurs: the hold starts again
    assert model.update(0, plain, 2100.0).health.state == "failed"
    assert model.update(0, plain, 2200.0).health.state == "healthy"
    # A driver that reports the field keeps the Xid until the action returns to none.
    model = HealthModel(from_dict({"health": {"xid_fatal_hold_s": 600}}).health)
    model.observe_xid(0, 48, 1000.0)
    reporting = GpuSample(index=0, uuid="GPU-x", recovery_action=1)
    assert model.update(0, reporting, 5000.0).health.state == "failed"
    assert model.update(0, GpuSample(index=0, uuid="GPU-x", recovery_action=0), 5001.0).health.state == "healthy"
