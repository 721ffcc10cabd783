"""The shipped rules as a Prometheus Operator `PrometheusRule` (deploy/kubernetes), built by
mscale.rules.render from the same groups as the rule files, so the cluster evaluates exactly
what promtool tested."""

from __future__ import annotations

from typing import Any

PROMETHEUS_RULE_FILE = "deploy/kubernetes/base/prometheusrule.yaml"


def prometheus_rule(groups: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "mscale", "labels": {"app.kubernetes.io/component": "rules"}},
        "spec": {"groups": groups},
    }
