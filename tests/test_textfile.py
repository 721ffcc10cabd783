"""Every data file the agent reads refuses an unreadable path with its own error, naming it."""

from __future__ import annotations

import pytest

from mscale.healing import policy
from mscale.probes.gpu_health import XidTableError, load_xid_table
from mscale.sim.timeline import TimelineError, load_timeline


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
