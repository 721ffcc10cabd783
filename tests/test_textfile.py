"""Every data file the agent reads refuses an unreadable path with its own error, naming it."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mscale.daemon.config import ConfigError
from mscale.daemon.config import load as load_config
from mscale.healing import policy
from mscale.probes.gpu_health import XidTableError, load_xid_table
from mscale.sim.timeline import TimelineError, load_timeline
from mscale.textfile import MAX_BYTES, decode


@pytest.mark.parametrize(
    "load, error, what",
    [
        (policy.load, policy.PolicyError, "healing policy"),
        (load_xid_table, XidTableError, "the Xid table"),
        (load_timeline, TimelineError, "the timeline"),
    ],
)
def test_unreadable_data_file_names_path_and_kind(tmp_path, load, error, what):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(error) as info:
        load(str(missing))
    assert str(missing) in str(info.value) and f"cannot read {what}" in str(info.value)
    assert "No such file" in str(info.value)


LOADERS = [
    (policy.load, policy.PolicyError),
    (load_xid_table, XidTableError),
    (load_timeline, TimelineError),
]


@pytest.mark.parametrize("load, error", LOADERS)
@pytest.mark.parametrize("data,line,column", [(b"\xff", 1, 1), (b"ok\nok\n\xc3(", 3, 1), (b"a: 1\nb: caf\xe9\n", 2, 7)])
def test_not_utf8_names_file_line_and_first_bad_byte(tmp_path, load, error, data, line, column):
    path = tmp_path / "data"
    path.write_bytes(data)
    with pytest.raises(error) as info:
        load(str(path))
    assert str(info.value).startswith(f"{path} line {line}: not UTF-8 text (byte 0x")
    assert f"at column {column})" in str(info.value)


@pytest.mark.parametrize("load, error", LOADERS)
def test_fifo_and_directory_refused_without_waiting(tmp_path, load, error):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no writer: a plain open() would wait for one forever
    with pytest.raises(error, match="not a regular file"):
        load(str(fifo))
    with pytest.raises(error, match="a directory"):
        load(str(tmp_path))


def test_config_not_utf8_and_too_large(tmp_path):
    path = tmp_path / "agent.toml"
    path.write_bytes(b'[agent]\nnode = "\xff"\n')
    with pytest.raises(ConfigError, match=rf"^{path} line 2: not UTF-8 text \(byte 0xff at column 9\)"):
        load_config(path)
    with path.open("wb") as f:
        f.truncate(MAX_BYTES + 1)  # sparse: no 16 MiB written
    with pytest.raises(ConfigError, match="bytes \\(at most"):
        load_config(path)


@given(data=st.binary(max_size=64))
def test_fuzzed_bytes_are_text_or_a_clear_refusal(data):
    try:
        text = decode(data, "f", ValueError)
    except ValueError as e:
        assert str(e).startswith("f line ") and "not UTF-8 text" in str(e)
        line = int(str(e).split()[2].rstrip(":"))
        assert 1 <= line <= data.count(b"\n") + 1
    else:
        assert text.encode() == data
