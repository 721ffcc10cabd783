"""The healing policy file, the fuse state machine and the engine's books (no torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mscale.findings import Finding, Reason, Severity
from mscale.healing import actions
from mscale.healing import policy as policymod
from mscale.healing.engine import Condition, Decision, HealingEngine, Target
from mscale.healing.fsm import IllegalTransition, Level, MpuFuseState
from mscale.healing.policy import PolicyError
from mscale.healing.settings import HealingSection


def test_shipped_policy_loads_and_names_only_known_actions():
    pol = policymod.load("")
    assert {r.name for r in pol.rules} >= {"mpu_output_corrupt", "gpu_fatal", "loss_spike", "loss_nonfinite"}
    for r in pol.rules:
        for acts in r.actions.values():
            assert set(acts) <= set(actions.NAMES)
    for name in actions.NAMES:  # every registered spec names itself
        assert actions.get(name).name == name
    rule = pol.match("reason", "checksum_l1_trigger")
    assert rule.actions_at("healthy") == ("l1_swap",)
    assert rule.actions_at("l1_swapped") == ("l2_degrade",)
    assert rule.actions_at("l2_degraded") == ("l3_distill",)
    assert pol.match("alert", "MscaleGpuFatalXid").name == "gpu_fatal"
    assert pol.match("reason", "gpu_xid", "warning") is None  # a non-fatal Xid is not a GPU fault
    assert pol.match("reason", "probe_down") is None


BAD = [
    (
        "version: 1\nrules:\n  - name: a\n    target: mpu\n    reasons: [no_such_reason]\n    actions: {any: [l1_swap]}\n",
        "line 5",
        "unknown 'no_such_reason'",
    ),
    (
        "version: 1\nrules:\n  - name: a\n    target: mpu\n    reasons: [gpu_xid]\n    actions: {any: [reboot]}\n",
        "line 6",
        "unknown 'reboot'",
    ),
    (
        "version: 1\nrules:\n  - name: a\n    target: moon\n    reasons: [gpu_xid]\n    actions: {}\n",
        "line 4",
        "target",
    ),
    (
        "version: 1\nrules:\n  - name: a\n    target: job\n    reasons: [gpu_xid]\n    actions:\n      l2_degraded: [rollback]\n",
        "line 7",
        "unknown level 'l2_degraded'",
    ),
    ("version: 1\nrules:\n  - name: a\n    target: mpu\n    actions: {any: []}\n", "line 3", "needs reasons or alerts"),
    ("version: 1\nrules:\n  - name: a\n    targte: mpu\n", "line 4", "unknown key 'targte'"),
    ("version: 2\nrules: []\n", "line 1", "version"),
    ("version: 1\nrules:\n  - name: a\n    target: [\n", "line", "not valid YAML"),
    ("version: 1\ndedup_window_s: soon\nrules: []\n", "line 2", "dedup_window_s"),
]


@pytest.mark.parametrize("text,line,words", BAD)
def test_malformed_policy_names_the_line(text, line, words):
    with pytest.raises(PolicyError) as e:
        policymod.parse(text, "p.yaml")
    assert f"p.yaml: {line}" in str(e.value) or (line == "line" and "line" in str(e.value))
    assert words in str(e.value)


def test_agent_refuses_to_start_on_a_malformed_policy(tmp_path: Path):
    bad = tmp_path / "policy.yaml"
    bad.write_text(
        "version: 1\nrules:\n  - name: a\n    target: mpu\n    reasons: [gpu_xid]\n    actions: {any: [explode]}\n"
    )
    cfg = tmp_path / "agent.toml"
    cfg.write_text(f'[healing]\npolicy = "{bad}"\n[agent]\nlisten = "127.0.0.1:0"\nsocket_path = "{tmp_path}/s.sock"\n')
    r = subprocess.run(
        [sys.executable, "-m", "mscale", "agent", "--config", str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2, r.stderr
    assert "line 6" in r.stderr and "explode" in r.stderr


def test_state_machine_walks_the_fuse_and_needs_a_clean_stretch():
    f = MpuFuseState("j", "001", clean_steps=3)
    f.to(Level.SUSPECT)
    f.to(Level.L1_SWAPPED)
    f.to(Level.L2_DEGRADED)
    f.to(Level.L3_DISTILLING)
    with pytest.raises(IllegalTransition):
        f.to(Level.L1_SWAPPED)
    assert f.clean_step(1) is None and f.clean_step(2) is None
    f.failed()  # a failure resets the stretch
    assert f.clean_step(3) is None and f.clean_step(4) is None
    tr = f.clean_step(5)
    assert tr and tr.after is Level.RECOVERED
    assert [f.clean_step(s) for s in (6, 7)] == [None, None]
    assert f.clean_step(8).after is Level.HEALTHY
    assert [t.after for t in f.history] == [
        Level.SUSPECT,
        Level.L1_SWAPPED,
        Level.L2_DEGRADED,
        Level.L3_DISTILLING,
        Level.RECOVERED,
        Level.HEALTHY,
    ]
    with pytest.raises(IllegalTransition):
        MpuFuseState("j", "1").to(Level.L3_DISTILLING)  # no skipping to L3 from healthy


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _engine(**cfg):
    clock, events = Clock(), []
    eng = HealingEngine(policymod.load(""), HealingSection(**cfg), clock=clock, emit=events.append)
    return eng, clock, events


def test_engine_escalates_per_level_and_books_every_decision():
    eng, clock, events = _engine()

    def tgt(rule, cond):
        return [Target("j1", "001", 0)]

    for step, expect in ((10, "l1_swap"), (20, "l2_degrade"), (30, "l3_distill")):
        (d,) = eng.decide(
            Condition(kind="reason", name="checksum_l1_trigger", labels={"mpu_id": "001"}, step=step, occurrence=step),
            tgt,
        )
        assert d.action == expect
        eng.record(d, "applied")
    assert eng.mpu("j1", "001").level is Level.L3_DISTILLING
    assert (
        eng.decide(Condition(kind="reason", name="checksum_l1_trigger", labels={}, occurrence=40), tgt) == []
    )  # last level: keep
    assert eng.drift[("j1", "001")] == 1
    assert eng.actions[("L1", "l1_swap", "001", "applied")] == 1
    assert eng.actions[("L3", "l3_distill", "001", "applied")] == 1
    heal = [e for e in events if e.reason is Reason.HEAL_ACTION]
    states = [e.labels["state"] for e in events if e.reason is Reason.FUSE_STATE]
    assert [e.labels["action"] for e in heal] == ["l1_swap", "l2_degrade", "l3_distill"]
    assert states == ["l1_swapped", "l2_degraded", "l3_distilling"]


def test_same_fault_from_probe_and_alert_acts_once_within_the_window():
    eng, clock, events = _engine()

    def tgt(rule, cond):
        return [Target("j1", "002", 3, "GPU-x")]

    probe = Condition(kind="reason", name="gpu_xid", labels={"gpu_uuid": "GPU-x"}, severity="critical")
    alert = Condition(kind="alert", name="MscaleGpuFatalXid", labels={"gpu_uuid": "GPU-x"})
    first = eng.decide(probe, tgt)
    assert [d.action for d in first] == ["emergency_snapshot", "quarantine_gpu", "l1_swap"]
    clock.t += 30
    assert eng.decide(alert, tgt) == []  # the alert for the same Xid: a duplicate
    assert eng.actions[("none", "emergency_snapshot", "002", "duplicate")] == 1
    clock.t += 61
    assert len(eng.decide(alert, tgt)) == 3  # past the window it is a new fault


def test_loss_spike_cools_then_a_persisting_spike_rolls_back():
    eng, clock, events = _engine(lr_cool_steps=5)

    def tgt(rule, cond):
        return [Target("j1")]

    (d,) = eng.decide(Condition(kind="reason", name="loss_spike_action", labels={}, occurrence=100), tgt)
    assert d.action == "lr_cool"
    # the ratio detector fires for the same step: one fault, acted on once
    assert eng.decide(Condition(kind="reason", name="loss_jump", labels={}, occurrence=100), tgt) == []
    eng.record(d, "applied")  # the job's cooling window opens
    assert eng.job("j1").level == "cooling"
    (d,) = eng.decide(Condition(kind="reason", name="loss_spike_action", labels={}, occurrence=101), tgt)
    assert d.action == "rollback"
    eng.record(
        Decision(
            rule=d.rule,
            action="lr_cool",
            level="none",
            target=Target("j1"),
            before="cooling",
            reason="cooling_end",
            why="window over",
        ),
        "ended",
    )
    assert eng.job("j1").level == "healthy"
    (d,) = eng.decide(Condition(kind="reason", name="loss_spike_action", labels={}, occurrence=102), tgt)
    assert d.action == "lr_cool"
    (d,) = eng.decide(Condition(kind="reason", name="loss_nonfinite", labels={}, occurrence=300), tgt)
    assert d.action == "rollback"


def test_swap_rate_limit_escalates_to_l2():
    eng, clock, events = _engine(max_swaps_per_hour=2)

    def tgt(rule, cond):
        return [Target("j1", "001", 0)]

    for step in (1, 2):
        (d,) = eng.decide(Condition(kind="alert", name="MscaleGpuFatalXid", labels={}, occurrence=step), tgt)[-1:]
        assert d.action == "l1_swap"
        eng.record(d, "applied")
        clock.t += 1
    decisions = eng.decide(Condition(kind="alert", name="MscaleGpuFatalXid", labels={}, occurrence=3), tgt)
    assert decisions[-1].action == "l2_degrade" and "swaps in the last hour" in decisions[-1].why
    assert eng.actions[("L1", "l1_swap", "001", "rate_limited")] == 1


def test_disabled_engine_records_but_does_not_act():
    eng, clock, events = _engine(enabled=False)
    out = eng.decide(
        Condition(kind="reason", name="loss_nonfinite", labels={}, occurrence=1), lambda r, c: [Target("j")]
    )
    assert out == [] and eng.actions[("none", "rollback", "", "disabled")] == 1


def test_observing_a_jobs_own_action_makes_the_alert_a_duplicate():
    eng, clock, events = _engine()
    eng.observe(
        Finding(
            "fuse",
            Reason.HEAL_ACTION,
            Severity.WARNING,
            "l1_swap applied",
            {
                "rule": "mpu_output_corrupt",
                "action": "l1_swap",
                "level": "L1",
                "result": "applied",
                "job_id": "j1",
                "mpu_id": "001",
                "state": "l1_swapped",
            },
        )
    )
    assert eng.mpu("j1", "001").level is Level.L1_SWAPPED and eng.drift[("j1", "001")] == 1

    def tgt(rule, cond):
        return [Target("j1", "001")]

    assert (
        eng.decide(
            Condition(kind="alert", name="MscaleChecksumFailures", labels={"job_id": "j1", "mpu_id": "001"}), tgt
        )
        == []
    )


def test_swap_rate_limit_past_l2_escalates_to_l3():
    eng, clock, events = _engine(max_swaps_per_hour=1)

    def tgt(rule, cond):
        return [Target("j1", "001", 0)]

    (d,) = eng.decide(Condition(kind="alert", name="MscaleGpuFatalXid", labels={}), tgt)[-1:]
    eng.record(d, "applied")  # one swap: the budget is spent
    eng.move("j1", "001", Level.L2_DEGRADED)
    clock.t += 61
    (d,) = eng.decide(Condition(kind="alert", name="MscaleGpuFatalXid", labels={}), tgt)[-1:]
    assert d.action == "l3_distill" and "swaps in the last hour" in d.why  # not L2 again: it holds L2


def test_job_and_gpu_scoped_actions_run_once_per_job_mpu_scoped_ones_per_mpu():
    eng, clock, events = _engine()

    def both(rule, cond):
        return [Target("j1", "001", 2, "GPU-2"), Target("j1", "002", 2, "GPU-2"), Target("j2", "001", 2, "GPU-2")]

    out = eng.decide(Condition(kind="reason", name="gpu_xid", labels={"gpu": "2"}, severity="critical"), both)
    got = sorted((d.action, d.target.job_id, d.target.mpu_id) for d in out)
    assert got == [
        ("emergency_snapshot", "j1", "001"),
        ("emergency_snapshot", "j2", "001"),
        ("l1_swap", "j1", "001"),
        ("l1_swap", "j1", "002"),
        ("l1_swap", "j2", "001"),
        ("quarantine_gpu", "j1", "001"),
        ("quarantine_gpu", "j2", "001"),
    ]


def test_a_resolved_alert_ends_only_the_cooling_its_rule_started():
    eng, clock, events = _engine()

    def tgt(rule, cond):
        return [Target("j1")]

    # the job reports its own cooling (the agent mirrors it), then the spike alert resolves
    eng.observe(
        Finding(
            "fuse",
            Reason.HEAL_ACTION,
            Severity.WARNING,
            "lr_cool applied",
            {"rule": "loss_spike", "action": "lr_cool", "level": "none", "result": "applied", "job_id": "j1"},
        )
    )
    assert eng.snapshot().cooling == ("j1",)
    hang = Condition(kind="alert", name="MscaleTrainingHang", labels={"job_id": "j1"})
    assert eng.resolve(hang, tgt, eng.match(hang)) == []  # its rule cools nothing
    spike = Condition(kind="alert", name="MscaleLossSpike", labels={"job_id": "j1"})
    (end,) = eng.resolve(spike, tgt, eng.match(spike))
    assert end.action == "lr_cool" and end.command(end=True).end is True and "resolved" in end.why
    assert eng.snapshot().cooling == ("j1",)  # until the job says the window ended
    eng.observe(
        Finding(
            "fuse",
            Reason.HEAL_ACTION,
            Severity.INFO,
            "lr_cool ended",
            {"rule": "loss_spike", "action": "lr_cool", "level": "none", "result": "ended", "job_id": "j1"},
        )
    )
    assert eng.snapshot().cooling == () and eng.resolve(spike, tgt, eng.match(spike)) == []


def test_every_action_declares_a_consistent_spec():
    """The contract each action meets (what the engine and the fuse rely on): a spec in the
    torch-free catalogue and an executor on the job side, the same actions in the same order."""
    from mscale.hook.fuse import actions as executors

    specs = actions.specs()
    assert [e.name for e in executors.executors()] == list(actions.NAMES)
    assert [s.name for s in specs] == list(actions.NAMES)
    assert [s.name for s in specs if s.on_recovery] == [actions.recovery().name]
    for s in specs:
        assert s.scope in ("mpu", "gpu", "job") and s.level in ("L1", "L2", "L3", "none") and s.help
        ex = executors.get(s.name)
        assert ex.spec is s and callable(ex.apply)
        if s.escalates_to is not None:  # escalation climbs the fuse
            nxt = actions.get(s.escalates_to)
            assert s.moves_to is not None and nxt.moves_to is not None and nxt.level > s.level
        assert not s.escalate_on_failure or s.escalates_to
        assert not (s.drift or s.reruns_forward or s.new_placement) or (s.scope == "mpu" and s.moves_to is not None)
        assert not s.cools_job or (s.scope == "job" and ex.end is not None)


def test_no_action_is_named_outside_its_module():
    """The engine, the fuse plugin, the agent's healing service and the webhook act on the
    actions' declarations, never on their names."""
    root = Path(__file__).resolve().parent.parent / "mscale"
    for rel in ("healing/engine.py", "hook/fuse/fuse.py", "daemon/healing.py", "daemon/webhook.py"):
        text = (root / rel).read_text()
        for name in actions.NAMES:
            assert f'"{name}"' not in text and f"'{name}'" not in text, f"{rel} names the action {name}"


def test_not_escalated_is_healthy_everywhere():
    """One word for an MPU that no fuse level holds: the state machine's, the agent's view of a
    job's MPU (and so `mscale_mpu_info{fuse_level}` and the status API) before any report."""
    from mscale.daemon.mpu_state import MpuState

    assert MpuState("001", "vision", 0).fuse_level == Level.HEALTHY.value == "healthy"
    assert Level.HEALTHY.number == 0 and Level.L3_DISTILLING.number == 3


def test_a_gpu_fault_stays_one_fault_after_its_mpus_moved_off():
    eng, clock, events = _engine()

    def on_gpu(rule, cond):
        return [Target("j1", "001", 2, "GPU-2")]

    def moved(rule, cond):
        return [Target("", "", 2, "GPU-2")]  # the agent finds no MPU there any more

    assert (
        len(eng.decide(Condition(kind="reason", name="gpu_xid", labels={"gpu": "2"}, severity="critical"), on_gpu)) == 3
    )
    clock.t += 2
    assert (
        eng.decide(Condition(kind="alert", name="MscaleGpuFatalXid", labels={"gpu": "2"}), moved) == []
    )  # the same fault


# --- issue 16 item 8: malformed bytes and values, fuzzing (parser only) ---------------------


@pytest.mark.parametrize(
    "text,line,words",
    [
        ("version: 1\n# \x00\nrules: []\n", "line 2", ["not valid YAML", "#x0000"]),
        ("\x1f", "line 1", ["not valid YAML"]),
        ("version: 1\ndedup_window_s: .nan\nrules: []\n", "line 2", ["dedup_window_s"]),
        ("version: 1\ndedup_window_s: nan\nrules: []\n", "line 2", ["dedup_window_s"]),
        ("version: 1\ndedup_window_s: 1e400\nrules: []\n", "line 2", ["dedup_window_s"]),
        ("version: 1\ndedup_window_s: " + "9" * 400 + "\nrules: []\n", "line 2", ["dedup_window_s"]),
        ("version: 1\n? [a]\n: 1\n", "line 2", ["plain names"]),
        ("version: 1\nrules: &a [*a]\n", "line 2", ["rule: expected a mapping"]),
    ],
)
def test_issue_16_policies_refused_with_file_and_line(text, line, words):
    with pytest.raises(PolicyError) as e:
        policymod.parse(text, "p.yaml")
    assert str(e.value).startswith(f"p.yaml: {line}:"), str(e.value)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_not_utf8_policy_names_file_and_line(tmp_path: Path):
    path = tmp_path / "p.yaml"
    path.write_bytes(b"version: 1\nrules:\n  - name: caf\xe9\n")
    with pytest.raises(PolicyError, match=rf"^{path} line 3: not UTF-8 text \(byte 0xe9 at column 14\)"):
        policymod.load(path)


def test_deeply_nested_policy_is_refused():
    with pytest.raises(PolicyError, match=r"^p\.yaml: not valid YAML: nested too deeply"):
        policymod.parse("version: 1\nrules: " + "[" * 5000 + "]" * 5000, "p.yaml")


_SHIPPED = policymod.default_text()[0].split("\n")
_JUNK = [
    "version: 2", "rules: []", "rules: {}", "dedup_window_s: .nan", "dedup_window_s: -1", "    target: moon",
    "    actions: {any: [reboot]}", "    reasons: [no_such]", "  - name: x", "- 1", "? [a]", ": b", "&a [*a]",
    "    labels: {a: [b]}", "    severities: [loud]", "    decide: later", "\t", "'", "{", "*nope", "!!int x",
]  # fmt: skip


@given(
    edits=st.lists(
        st.tuples(
            st.integers(0, len(_SHIPPED)),
            st.sampled_from(["replace", "insert", "delete"]),
            st.sampled_from(_JUNK) | st.text(max_size=12),
        ),
        max_size=4,
    )
)
def test_fuzzed_policy_is_a_policy_or_a_clear_refusal(edits):
    """The shipped policy, mutated line by line: a Policy, or a PolicyError naming file and line."""
    lines = list(_SHIPPED)
    for at, how, junk in edits:
        at = min(at, len(lines))
        if how == "insert":
            lines.insert(at, junk)
        elif lines and at < len(lines):
            if how == "delete":
                del lines[at]
            else:
                lines[at] = junk
    try:
        pol = policymod.parse("\n".join(lines), "p.yaml")
    except PolicyError as e:
        msg = str(e)
        assert msg.startswith("p.yaml: line ") or msg == "p.yaml: empty healing policy", msg
    else:
        assert pol.rules and 0 <= pol.dedup_window_s <= 86400
        for rule in pol.rules:
            assert rule.target in policymod.TARGETS
            assert all(a in actions.NAMES for acts in rule.actions.values() for a in acts)


def test_a_move_to_the_level_an_mpu_holds_is_no_transition_and_no_refusal(capsys):
    eng, _, events = _engine()
    assert eng.move("j", "001", Level.SUSPECT) is not None
    n = len(events)
    assert eng.move("j", "001", Level.SUSPECT) is None
    assert len(events) == n and "fuse_transition_refused" not in capsys.readouterr().out
