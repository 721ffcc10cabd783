"""In-job verdicts handed to node remediation (issue 26 item 3): a GPU the fuse proved at fault
(an MPU's outputs failed there and came clean on the standby) or a fatal Xid is filed as an
NVSentinel ExternalFault (against the local API server the Kubernetes tests use, every field
checked), as the node condition's SDC reason, and through a command hook (a real script that
writes its argv and environment to a file); each filing once per GPU and fault, rate-limited,
retried when it fails, and undone only after the GPU was reset and passed its health checks."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from mscale.daemon.config import ConfigError, from_dict
from mscale.daemon.state import AgentState
from mscale.findings import Finding, Reason, Severity
from mscale.kube.remediation.service import SNAPSHOT, RemediationService, build_filers
from mscale.kube.service import KubeService
from mscale.kube.settings import KubernetesSection
from mscale.probes.gpu_sample import GpuSnapshot
from support.kube import ApiServer, four_gpus, wait_until

NODE = "gpu-node-1"
GROUP, VERSION, PLURAL = "nvsentinel.dgxc.nvidia.com", "v1", "externalfaults"


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def gpus(*, failed: tuple[int, ...] = (), resets: dict[int, int] | None = None, degraded=()) -> GpuSnapshot:
    return four_gpus(failed, degraded, degraded_reason="hot", resets=resets)


def swap(gpu: int, to: int, *, job="j1", rank="0", mpu="001", reason="checksum_l1_trigger", action="l1_swap"):
    """What the link re-emits of a job's heal_action: the job's labels plus its job_id and rank."""
    labels = {
        "rule": "checksum_l1",
        "action": action,
        "level": "L1",
        "result": "applied",
        "job_id": job,
        "mpu_id": mpu,
        "gpu": str(gpu),
        "gpu_uuid": f"GPU-{gpu}",
        "reason": reason,
        "to_gpu": str(to),
        "rank": rank,
        "local_rank": rank,
    }
    return Finding("hook:fuse", Reason.HEAL_ACTION, Severity.CRITICAL, f"{action} applied", labels)


def clean_on_standby(*, job="j1", rank="0", mpu="001"):
    labels = {"job_id": job, "mpu_id": mpu, "before": "l1_swapped", "state": "recovered", "rank": rank}
    return Finding("hook:fuse", Reason.FUSE_STATE, Severity.INFO, "recovered", labels)


def service(
    state: AgentState, clock: Clock, *, _kube: dict | None = None, _boot: str = "boot-1", **remediation
) -> RemediationService:
    cfg = from_dict({"remediation": remediation, "kubernetes": _kube or {}})
    return RemediationService(state, cfg.remediation, build_filers(cfg, state, clock), clock=clock, boot=_boot)


def findings(state: AgentState, reason: Reason) -> list[Finding]:
    return [f for _, f in state.events.since(0) if f.reason is reason]


# --- the command hook: a real script ------------------------------------------------------


@pytest.fixture
def hook(tmp_path: Path):
    """A script that appends one JSON line {argv, env} per run to calls.jsonl, then exits with
    the code in exit_code (0 when absent)."""
    calls, code = tmp_path / "calls.jsonl", tmp_path / "exit_code"
    script = tmp_path / "gpu-remediate"
    script.write_text(
        textwrap.dedent(
            f"""\
            #!{sys.executable}
            import json, os, sys
            with open({str(calls)!r}, "a") as f:
                f.write(json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ)}}) + "\\n")
            print("remediation hook ran")
            sys.exit(int(open({str(code)!r}).read()) if os.path.exists({str(code)!r}) else 0)
            """
        )
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)

    class Hook:
        path = str(script)

        @staticmethod
        def calls() -> list[dict]:
            return [json.loads(line) for line in calls.read_text().splitlines()] if calls.exists() else []

        @staticmethod
        def exit_with(rc: int) -> None:
            code.write_text(str(rc))

    return Hook


async def test_sdc_verdict_runs_the_command_with_the_facts_once_and_undoes_it_after_reset(hook, monkeypatch) -> None:
    monkeypatch.setenv("MSCALE_WEBHOOK_TOKEN", "agent-secret")  # the agent's own env never reaches the hook
    clock, state = Clock(), AgentState(node=NODE)
    state.publish("gpu", gpus())
    svc = service(state, clock, command={"enabled": True, "argv": [hook.path, "--site", "dc1"]}, clear_healthy_checks=2)

    await svc.observe(swap(2, 3))
    assert hook.calls() == [] and not findings(state, Reason.GPU_FAULT_VERDICT)  # a swap alone proves nothing
    await svc.observe(clean_on_standby())
    (verdict,) = findings(state, Reason.GPU_FAULT_VERDICT)
    assert verdict.labels == {
        "gpu": "2",
        "gpu_uuid": "GPU-2",
        "kind": "sdc",
        "cause": "GPUSilentDataCorruption",
        "action": "COMPONENT_RESET",
        "job_id": "j1",
        "rank": "0",
        "mpu_id": "001",
        "standby_gpu": "3",
    }
    assert "came clean on standby GPU 3" in verdict.message and verdict.severity is Severity.CRITICAL
    (call,) = hook.calls()
    assert call["argv"] == [
        "--site",
        "dc1",
        "file",
        NODE,
        "GPU-2",
        "2",
        "sdc",
        "GPUSilentDataCorruption",
        "COMPONENT_RESET",
    ]
    env = call["env"]
    assert {k: v for k, v in env.items() if k != "MSCALE_MESSAGE"} == {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
        "MSCALE_EVENT": "file",
        "MSCALE_NODE": NODE,
        "MSCALE_GPU_UUID": "GPU-2",
        "MSCALE_GPU_INDEX": "2",
        "MSCALE_FAULT_KIND": "sdc",
        "MSCALE_FAULT_REASON": "GPUSilentDataCorruption",
        "MSCALE_RECOMMENDED_ACTION": "COMPONENT_RESET",
        "MSCALE_FAULT_ID": "sdc-gpu-2",
        "MSCALE_SINCE": f"{clock.t:.3f}",
        "MSCALE_JOB_ID": "j1",
        "MSCALE_RANK": "0",
        "MSCALE_MPU_ID": "001",
        "MSCALE_STANDBY_GPU": "3",
    }
    assert env["MSCALE_MESSAGE"].startswith("GPU 2 (GPU-2) computes wrong: MPU 001 of job j1 rank 0")
    filed = findings(state, Reason.REMEDIATION_FILING)[-1]
    assert filed.labels["filer"] == "command" and filed.labels["result"] == "filed"
    assert filed.labels["exit_code"] == "0"

    # idempotent: the same GPU proven again (another MPU, another rank), more turns: no second run
    await svc.observe(swap(2, 6, rank="1", mpu="002"))
    await svc.observe(clean_on_standby(rank="1", mpu="002"))
    for _ in range(5):
        clock.t += 10
        await svc.turn()
    assert len(hook.calls()) == 1 and len(findings(state, Reason.GPU_FAULT_VERDICT)) == 1

    # healthy in the probe's eyes all along, but never reset: nothing is undone
    assert state.snapshots[SNAPSHOT].filed["command"][0].gpu_uuid == "GPU-2"
    # reset (the health model saw it), then degraded: no passed check; then two healthy checks
    state.publish("gpu", gpus(resets={2: 1}, degraded=(2,)))
    await svc.turn()
    state.publish("gpu", gpus(resets={2: 1}))
    await svc.turn()
    assert len(hook.calls()) == 1
    await svc.turn()
    assert [c["argv"][2] for c in hook.calls()] == ["file", "clear"]
    assert hook.calls()[1]["env"]["MSCALE_EVENT"] == "clear"
    (cleared,) = findings(state, Reason.GPU_FAULT_CLEARED)
    assert cleared.labels["gpu_uuid"] == "GPU-2" and "reset and 2 healthy checks" in cleared.message
    st = state.snapshots[SNAPSHOT]
    assert st.faults == () and st.filed["command"] == ()
    assert st.filings == {("command", "file", "filed"): 1, ("command", "clear", "cleared"): 1}
    assert st.command_exit == {"file": 0, "clear": 0}


async def test_every_remediation_series_is_documented_with_its_labels(hook) -> None:
    """The series a filing makes (most have no sample in the live scrape of tests/test_metrics_doc.py)
    against docs/metrics.md's rows, by their exposed name, type and labels."""
    from prometheus_client import generate_latest
    from test_metrics_doc import documented, exposed

    from mscale.daemon.exporters import make_registry

    clock, state = Clock(), AgentState(node=NODE)
    state.publish("gpu", gpus(failed=(1,)))
    svc = service(state, clock, command={"enabled": True, "argv": [hook.path]})
    await svc.turn()
    page = generate_latest(make_registry(state, ("mscale.daemon.exporters.remediation",))).decode()
    got, docs = exposed(page), documented()
    assert set(got) == {
        "mscale_remediation_gpu_fault",
        "mscale_remediation_filed",
        "mscale_remediation_filings_total",
        "mscale_remediation_filer_up",
        "mscale_remediation_command_exit_code",
    }
    for name, (typ, labels) in got.items():
        assert docs[name] == (typ, labels), name
    assert 'mscale_remediation_filings_total{event="file",filer="command",result="filed"} 1.0' in page
    assert 'mscale_remediation_command_exit_code{event="file"} 0.0' in page


@pytest.mark.parametrize(
    "evidence",
    [
        [swap(2, 5), swap(5, 6), clean_on_standby()],  # the standby failed too: the fault followed the MPU
        [swap(2, 5), swap(5, 5, action="l2_degrade"), clean_on_standby()],  # ... and it went L2
        [swap(2, 5, reason="gpu_xid"), clean_on_standby()],  # a swap for a GPU fault the probe saw, not SDC
        [clean_on_standby()],  # recovered with no swap on the books
        [swap(2, 5, rank="0"), clean_on_standby(rank="1")],  # another rank's MPU came clean
    ],
    ids=["standby-failed", "degraded", "xid-swap", "no-swap", "other-rank"],
)
async def test_no_verdict_without_a_swap_that_came_clean(hook, evidence) -> None:
    clock, state = Clock(), AgentState(node=NODE)
    state.publish("gpu", gpus())
    svc = service(state, clock, command={"enabled": True, "argv": [hook.path]})
    for f in evidence:
        await svc.observe(f)
    await svc.turn()
    assert not findings(state, Reason.GPU_FAULT_VERDICT) and hook.calls() == []


async def test_a_verdict_outlives_an_agent_restart_and_a_reboot_is_its_reset(hook, tmp_path: Path) -> None:
    clock, state_file = Clock(), str(tmp_path / "remediation.json")
    cfg = {"command": {"enabled": True, "argv": [hook.path]}, "state_file": state_file, "clear_healthy_checks": 1}
    state = AgentState(node=NODE)
    state.publish("gpu", gpus())
    svc = service(state, clock, **cfg)
    await svc.observe(swap(2, 5))
    await svc.observe(clean_on_standby())
    assert len(hook.calls()) == 1 and json.loads(Path(state_file).read_text())["faults"][0]["gpu_uuid"] == "GPU-2"

    # the agent restarts on the same boot: the verdict stands (no second filing, no undo: no reset seen)
    state = AgentState(node=NODE)
    state.publish("gpu", gpus())
    svc = service(state, clock, **cfg)
    for _ in range(3):
        await svc.turn()
    assert len(hook.calls()) == 1 and [f.gpu_uuid for f in state.snapshots[SNAPSHOT].faults] == ["GPU-2"]

    # ... and after the node rebooted (a new boot id: every GPU was reset), a healthy check undoes it
    state = AgentState(node=NODE)
    state.publish("gpu", gpus())
    svc = service(state, clock, _boot="boot-2", **cfg)
    await svc.turn()
    assert [c["argv"][0] for c in hook.calls()] == ["file", "clear"]
    assert json.loads(Path(state_file).read_text()) == {"version": 1, "faults": [], "filed": {"command": []}}


async def test_the_node_conditions_sdc_reason_outlives_an_agent_restart(tmp_path: Path) -> None:
    cfg = {"state_file": str(tmp_path / "remediation.json"), "_kube": {"enabled": True, "node_name": NODE}}
    state = AgentState(node=NODE)
    state.publish("gpu", gpus())
    svc = service(state, Clock(), **cfg)
    assert [f.name for f in svc.filers] == ["nodecondition"]
    await svc.observe(swap(2, 5))
    await svc.observe(clean_on_standby())
    assert [f.gpu_uuid for f in state.snapshots["remediation_sdc"]] == ["GPU-2"]
    state = AgentState(node=NODE)  # restarted: the condition's SDC faults are filed again at start
    state.publish("gpu", gpus())
    svc = service(state, Clock(), **cfg)
    await svc.turn()
    assert [f.gpu_uuid for f in state.snapshots["remediation_sdc"]] == ["GPU-2"]
    assert state.snapshots[SNAPSHOT].filings.get(("nodecondition", "file", "filed"), 0) == 0  # not a new filing


async def test_a_state_file_that_is_not_the_agents_is_set_aside(hook, tmp_path: Path) -> None:
    state_file = tmp_path / "remediation.json"
    state_file.write_text(json.dumps({"version": 1, "faults": {"kind": "sdc", "gpu": "two"}, "filed": {}}))
    state = AgentState(node=NODE)
    svc = service(state, Clock(), command={"enabled": True, "argv": [hook.path]}, state_file=str(state_file))
    assert svc.book.faults() == () and not state_file.exists()
    assert (tmp_path / "remediation.json.bad").exists()


async def test_fatal_xid_is_filed_and_undone_when_healthy_again(hook) -> None:
    clock, state = Clock(), AgentState(node=NODE)
    state.publish("gpu", gpus(failed=(1,)))
    svc = service(state, clock, command={"enabled": True, "argv": [hook.path]}, clear_healthy_checks=2)
    await svc.turn()
    (call,) = hook.calls()
    assert call["argv"] == ["file", NODE, "GPU-1", "1", "xid", "GPUXid79", "RESTART_BM"]
    assert call["env"]["MSCALE_XID"] == "79"
    await svc.turn()  # still failed: nothing more
    state.publish("gpu", gpus())  # the model clears a fatal Xid only at a reset
    await svc.turn()
    assert len(hook.calls()) == 1
    await svc.turn()
    assert [c["argv"][0] for c in hook.calls()] == ["file", "clear"]


async def test_a_failing_command_is_recorded_and_retried_after_the_interval(hook) -> None:
    clock, state = Clock(), AgentState(node=NODE)
    state.publish("gpu", gpus(failed=(3,)))
    svc = service(state, clock, command={"enabled": True, "argv": [hook.path]}, retry_interval_s=60)
    hook.exit_with(7)
    await svc.turn()
    failed = findings(state, Reason.REMEDIATION_FILING)[-1]
    assert (failed.labels["result"], failed.labels["exit_code"], failed.severity) == ("failed", "7", Severity.WARNING)
    assert "exit 7: remediation hook ran" in failed.message
    assert state.snapshots[SNAPSHOT].command_exit == {"file": 7}
    clock.t += 59
    await svc.turn()
    assert len(hook.calls()) == 1  # not before the retry interval
    hook.exit_with(0)
    clock.t += 2
    await svc.turn()
    assert len(hook.calls()) == 2
    assert state.snapshots[SNAPSHOT].filings == {("command", "file", "failed"): 1, ("command", "file", "filed"): 1}


async def test_filings_are_rate_limited_per_filer(hook) -> None:
    clock, state = Clock(), AgentState(node=NODE)
    state.publish("gpu", gpus(failed=(0, 1, 2)))
    svc = service(state, clock, command={"enabled": True, "argv": [hook.path]}, max_filings_per_hour=2)
    await svc.turn()
    await svc.turn()
    assert [c["argv"][2] for c in hook.calls()] == ["GPU-0", "GPU-1"]
    st = state.snapshots[SNAPSHOT]
    assert st.filings[("command", "file", "deferred")] == 1  # counted once, not every turn
    clock.t += 3600
    await svc.turn()
    assert [c["argv"][2] for c in hook.calls()] == ["GPU-0", "GPU-1", "GPU-2"]


async def test_the_command_runs_under_its_deadline_with_bounded_output(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    script = tmp_path / "slow"
    script.write_text(
        "#!/bin/sh\n"
        "head -c 1000000 /dev/zero | tr '\\0' x\n"  # a megabyte of output, kept to max_output_bytes
        f"sleep 300 & echo $! > {pidfile}\n"
        "wait\n"
    )
    script.chmod(0o755)
    clock, state = Clock(), AgentState(node=NODE)
    state.publish("gpu", gpus(failed=(0,)))
    svc = service(
        state, clock, command={"enabled": True, "argv": [str(script)], "timeout_s": 1.0, "max_output_bytes": 100}
    )
    await svc.turn()
    failed = findings(state, Reason.REMEDIATION_FILING)[-1]
    assert (failed.labels["result"], failed.labels["timed_out"], failed.labels["exit_code"]) == ("failed", "true", "-9")
    assert "no exit within 1s: killed" in failed.message
    child = int(pidfile.read_text())
    await wait_until(lambda: not _alive(child), what="the command's child killed with its group")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return status not in ("Z", "X")


async def test_output_is_kept_to_max_output_bytes(tmp_path: Path) -> None:
    script = tmp_path / "chatty"
    script.write_text("#!/bin/sh\nhead -c 1000000 /dev/zero | tr '\\0' x\nexit 3\n")
    script.chmod(0o755)
    clock, state = Clock(), AgentState(node=NODE)
    state.publish("gpu", gpus(failed=(0,)))
    svc = service(state, clock, command={"enabled": True, "argv": [str(script)], "max_output_bytes": 100})
    await svc.turn()
    (filer,) = svc.filers
    assert filer.last_output == "x" * 100 and filer.last_exit == {"file": 3}


def test_a_gpu_shown_at_fault_is_never_granted_as_a_standby() -> None:
    from mscale.daemon.standby import StandbyBook
    from mscale.link import StandbyRequest

    state, book = AgentState(node=NODE), StandbyBook()
    state.publish("gpu", gpus())
    state.events.on_emit(book.observe)
    svc = service(state, Clock())
    req = StandbyRequest.from_wire({"type": "standby_request", "id": 1, "mpu_id": "001", "gpu": 0, "avoid": []})
    assert book.choose(state, "j2", 0, req, 0.0)[0] == 1
    book.reserved.clear()
    svc.book.observe(swap(1, 3), state.snapshots["gpu"])
    svc.book.observe(clean_on_standby(), state.snapshots["gpu"])
    gpu, _, why = book.choose(state, "j2", 0, req, 0.0)
    assert gpu == 2 and 1 in book.quarantined


# --- ExternalFault against the local API server --------------------------------------------


@pytest.fixture
async def api():
    server = ApiServer()
    server.node(NODE)
    runner = await server.start()
    yield server
    await runner.cleanup()


def kube_cfg(api: ApiServer, **extra) -> dict:
    return {"enabled": True, "node_name": NODE, "api_server": api.url, "pod_resources_socket": "", **extra}


async def test_external_fault_follows_nvsentinels_schema_field_by_field(api: ApiServer) -> None:
    clock, state = Clock(), AgentState(node=NODE)
    state.publish("gpu", gpus())
    svc = service(state, clock, externalfault={"enabled": True}, nodecondition={"enabled": False}, _kube=kube_cfg(api))
    await svc.observe(swap(2, 3))
    await svc.observe(clean_on_standby())
    (post,) = [r for r in api.requests if r.method == "POST"]
    assert post.path == f"/apis/{GROUP}/{VERSION}/{PLURAL}"
    assert post.body == {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ExternalFault",
        "metadata": {
            "name": f"mscale-{NODE}-sdc-gpu-2",
            "labels": {
                "app.kubernetes.io/managed-by": "mscale-agent",
                "mscale.io/fault-kind": "sdc",
                "mscale.io/gpu-uuid": "GPU-2",
            },
        },
        "spec": {
            "healthEvent": {
                "version": 1,
                "agent": "mscale-agent",
                "componentClass": "GPU",
                "checkName": "MscaleGpuSilentDataCorruption",
                "isFatal": True,
                "isHealthy": False,
                "message": post.body["spec"]["healthEvent"]["message"],
                "recommendedAction": "COMPONENT_RESET",
                "errorCode": ["GPUSilentDataCorruption"],
                "entitiesImpacted": [
                    {"entityType": "GPU_UUID", "entityValue": "GPU-2"},
                    {"entityType": "GPU", "entityValue": "2"},
                ],
                "metadata": {
                    "source": "mscale-agent",
                    "faultKind": "sdc",
                    "gpuIndex": "2",
                    "gpuUuid": "GPU-2",
                    "mscaleRecommendedAction": "COMPONENT_RESET",
                    "bootId": "boot-1",
                    "jobId": "j1",
                    "rank": "0",
                    "mpuId": "001",
                    "standbyGpu": "3",
                },
                "generatedTimestamp": "2027-01-15T08:00:00Z",
                "nodeName": NODE,
                "processingStrategy": "EXECUTE_REMEDIATION",
                "id": f"mscale-sdc-gpu-2-{int(clock.t)}",
            }
        },
    }
    message = post.body["spec"]["healthEvent"]["message"]
    assert message.startswith("GPU 2 (GPU-2) computes wrong: MPU 001 of job j1 rank 0 failed its checks there")
    assert message.endswith(
        "Recommended action: drain the GPU's workloads and reset the GPU (nvidia-smi -r), or reboot the node"
    )
    assert list(api.custom[(GROUP, VERSION, PLURAL)]) == [f"mscale-{NODE}-sdc-gpu-2"]


async def test_external_fault_is_idempotent_across_restarts_and_deleted_after_reset(api: ApiServer) -> None:
    clock, state = Clock(), AgentState(node=NODE)
    state.publish("gpu", gpus(failed=(1,)))
    kube = kube_cfg(api)
    svc = service(
        state,
        clock,
        externalfault={"enabled": True, "custom_recommended_action": "external-remediation"},
        _kube=dict(kube),
        clear_healthy_checks=1,
    )
    await svc.turn()
    (obj,) = api.custom[(GROUP, VERSION, PLURAL)].values()
    event = obj["spec"]["healthEvent"]
    assert (event["checkName"], event["errorCode"], event["recommendedAction"]) == (
        "MscaleGpuFatalXid",
        ["79"],
        "CUSTOM",
    )
    assert event["customRecommendedAction"] == "external-remediation"
    assert event["metadata"]["mscaleRecommendedAction"] == "RESTART_BM" and event["metadata"]["xid"] == "79"

    # the agent restarts: its filing meets the object already there (409): filed, not twice
    state2 = AgentState(node=NODE)
    state2.publish("gpu", gpus(failed=(1,)))
    svc2 = service(state2, clock, externalfault={"enabled": True}, _kube=dict(kube), clear_healthy_checks=1)
    await svc2.turn()
    assert [r.method for r in api.requests if r.path.startswith("/apis/")] == ["POST", "POST"]
    assert findings(state2, Reason.REMEDIATION_FILING)[-1].labels["result"] == "exists"
    assert len(api.custom[(GROUP, VERSION, PLURAL)]) == 1

    state2.publish("gpu", gpus())
    await svc2.turn()
    delete = [r for r in api.requests if r.method == "DELETE"][-1]
    assert delete.path == f"/apis/{GROUP}/{VERSION}/{PLURAL}/mscale-{NODE}-xid-gpu-1"
    assert api.custom[(GROUP, VERSION, PLURAL)] == {}
    assert findings(state2, Reason.REMEDIATION_FILING)[-1].labels["result"] == "cleared"


async def test_an_admission_refusal_is_counted_and_retried(api: ApiServer) -> None:
    clock, state = Clock(), AgentState(node=NODE)
    state.publish("gpu", gpus(failed=(0,)))
    api.deny_custom = 'admission webhook denied the request: active ExternalFault "x" exists for node'
    svc = service(state, clock, externalfault={"enabled": True}, _kube=kube_cfg(api), retry_interval_s=30)
    await svc.turn()
    failed = findings(state, Reason.REMEDIATION_FILING)[-1]
    assert (failed.labels["result"], failed.labels["http_status"]) == ("failed", "400")
    assert "admission webhook denied" in failed.message
    api.deny_custom = ""
    clock.t += 31
    await svc.turn()
    assert len(api.custom[(GROUP, VERSION, PLURAL)]) == 1
    assert state.snapshots[SNAPSHOT].filings[("externalfault", "file", "filed")] == 1


async def test_no_external_fault_crd_says_so(api: ApiServer) -> None:
    clock, state = Clock(), AgentState(node=NODE)
    state.publish("gpu", gpus(failed=(0,)))
    svc = service(state, clock, externalfault={"enabled": True, "plural": "externalfaultz"}, _kube=kube_cfg(api))
    await svc.turn()
    failed = findings(state, Reason.REMEDIATION_FILING)[-1]
    assert (failed.labels["result"], failed.labels["http_status"]) == ("failed", "404")
    assert "(no externalfaultz.nvsentinel.dgxc.nvidia.com/v1 here: is NVSentinel's ExternalFault CRD installed?" in (
        failed.message
    )


# --- the node condition's SDC reason (Kubernetes without NVSentinel) ----------------------


async def test_sdc_verdict_sets_the_node_condition_and_cordon_until_reset_and_healthy(api: ApiServer) -> None:
    clock, state = Clock(), AgentState(node=NODE)
    state.publish("gpu", gpus())
    kube = KubernetesSection(**kube_cfg(api), condition_interval_s=3600, cordon=True, uncordon_healthy_checks=1)
    ks = KubeService(state, kube, clock=clock)
    await ks.start()
    svc = service(state, clock, _kube=kube_cfg(api), clear_healthy_checks=2)
    try:
        await wait_until(lambda: any(r.path.endswith("/status") for r in api.requests), what="the first condition")

        def cond() -> dict:
            return next(c for c in api.nodes[NODE]["status"]["conditions"] if c["type"] == "GPUUnhealthy")

        assert cond()["status"] == "False"
        await svc.observe(swap(3, 0))
        await svc.observe(clean_on_standby())
        assert await ks.check_node() == "cordoned"
        c = cond()
        assert (c["status"], c["reason"]) == ("True", "GPUSilentDataCorruption")
        assert c["message"].startswith("GPU 3 (GPU-3): silent data corruption: GPU 3 (GPU-3) computes wrong: MPU 001")
        assert c["message"].endswith(
            "Recommended action: drain the GPU's workloads and reset the GPU (nvidia-smi -r), or reboot the node."
        )
        assert api.nodes[NODE]["spec"]["unschedulable"] is True
        assert api.nodes[NODE]["metadata"]["annotations"]["mscale.io/cordon-reason"].startswith(
            "GPUSilentDataCorruption"
        )

        # healthy without a reset: the verdict, the condition and the cordon stand
        clock.t += 10
        await svc.turn()
        assert await ks.check_node() == "none" and cond()["status"] == "True"
        state.publish("gpu", gpus(resets={3: 1}))
        await svc.turn()
        assert await ks.check_node() == "none"
        await svc.turn()  # the second healthy check after the reset: undone
        assert state.snapshots["remediation_sdc"] == ()
        assert await ks.check_node() == "uncordoned"
        assert (cond()["status"], cond()["reason"]) == ("False", "GPUsHealthy")
        assert "unschedulable" not in api.nodes[NODE]["spec"]
    finally:
        await ks.stop()


# --- the reset the undo waits for, as the GPU probe sees it --------------------------------


def test_the_gpu_probe_counts_the_resets_it_sees() -> None:
    from mscale.probes.gpu import GpuProbe, NvmlReader
    from mscale.probes.gpu_health import HealthModel
    from mscale.sim.nvml import SimNvml
    from mscale.sim.timeline import FaultEvent

    clock = Clock()
    sim = SimNvml(2, clock=clock)
    found: list[Finding] = []
    probe = GpuProbe(NvmlReader(sim, backend="sim"), HealthModel(from_dict({}).health), emit=found.append, clock=clock)
    try:
        assert [g.resets for g in probe.sample().gpus] == [0, 0]
        sim.inject(FaultEvent(0, 1, "gpu_lost"))
        assert probe.sample().gpus[1].lost
        sim.inject(FaultEvent(0, 1, "recover"))  # a lost GPU answering again is a reset
        snap = probe.sample()
        assert [g.resets for g in snap.gpus] == [0, 1] and snap.gpus[1].health == "healthy"
        assert [g.resets for g in probe.sample().gpus] == [0, 1]
    finally:
        probe.close()


# --- config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"remediation": {"command": {"enabled": True}}}, "remediation.command.argv: needed"),
        ({"remediation": {"command": {"argv": ["gpu-remediate"]}}}, "must be an absolute path"),
        ({"remediation": {"command": {"timeout_s": 0}}}, "remediation.command.timeout_s: expected a value between"),
        ({"remediation": {"max_filings_per_hour": 0}}, "remediation.max_filings_per_hour: expected a value between"),
        ({"remediation": {"clear_healthy_checks": 1001}}, "remediation.clear_healthy_checks: expected a value"),
        ({"remediation": {"externalfault": {"api_version": "1"}}}, "remediation.externalfault.api_version"),
        ({"remediation": {"externalfault": {"processing_strategy": "NOW"}}}, "expected one of EXECUTE_REMEDIATION"),
        ({"remediation": {"externalfault": {"bogus": 1}}}, "remediation.externalfault.bogus: unknown key"),
        ({"remediation": {"state_file": "remediation.json"}}, "remediation.state_file: expected an absolute path"),
    ],
)
def test_config_is_range_checked(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        from_dict(data)


def test_external_fault_needs_kubernetes() -> None:
    cfg = from_dict({"remediation": {"externalfault": {"enabled": True}}})
    with pytest.raises(ConfigError, match="needs kubernetes.enabled = true"):
        build_filers(cfg, AgentState(node=NODE), Clock())


def test_defaults_file_nothing_off_the_cluster() -> None:
    cfg = from_dict({})
    assert cfg.remediation.enabled and not cfg.remediation.externalfault.enabled
    assert not cfg.remediation.command.enabled and cfg.remediation.nodecondition.enabled
    assert build_filers(cfg, AgentState(node=NODE), Clock()) == []  # the node condition is inert off the cluster


# --- end to end: a real job's fuse proves a GPU at fault, the real agent files it -----------


@pytest.mark.slow
def test_a_real_jobs_l1_swap_that_comes_clean_is_filed_by_the_agent(hook) -> None:
    """The tiny multimodal model trains on CPU against the embedded agent (simulated GPUs); its
    vision MPU's GPU 0 computes garbage for 30 steps (the demo's SDC fault); the fuse swaps the
    MPU to a standby, where it comes clean; the agent's command hook is run for GPU 0."""
    from mscale.demo.embedded import EmbeddedAgent
    from mscale.demo.scenario import Fault, Run, RunConfig
    from mscale.healing.settings import HealingSection
    from support.e2e import poll

    agent = EmbeddedAgent(gpus=8)
    remediation = from_dict({"remediation": {"command": {"enabled": True, "argv": [hook.path]}}}).remediation
    agent.config = agent.config.replace(remediation=remediation)
    with agent:
        run = Run(
            RunConfig(
                steps=60,
                socket_path=agent.socket_path,
                faults=(Fault(5, "corrupt", {"gpu": 0, "mode": "noise", "steps": 30}),),
                healing=HealingSection(recovery_clean_steps=10),
            )
        )
        try:
            vision = run.guard.mpu("vision")
            assert vision.gpu == 0
            while run.guard.current_step < 40 and not hook.calls():
                run.one_step()
            assert vision.gpu != 0  # swapped off the faulty GPU
            (call,) = poll("the agent's filing", hook.calls, timeout_s=30)
        finally:
            run.close()
    uuid = agent.nvml.uuids[0]
    assert call["argv"] == ["file", "sim-node", uuid, "0", "sdc", "GPUSilentDataCorruption", "COMPONENT_RESET"]
    env = call["env"]
    assert (env["MSCALE_JOB_ID"], env["MSCALE_MPU_ID"], env["MSCALE_RANK"]) == ("tinymm", vision.mpu_id, "0")
    assert env["MSCALE_STANDBY_GPU"] == str(vision.gpu)
