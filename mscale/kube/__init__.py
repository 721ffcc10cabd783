"""AGENT: running on Kubernetes. Pod attribution from the kubelet's pod-resources API
(podresources.py, attribution.py), the GPU-health node condition, Events and cordon through the
official Kubernetes client (node.py), run by the agent's kube service (service.py) when
[kubernetes] enabled is set; and the node remediation hand-off (remediation/: the GPU verdicts,
the filers, their ledger and service), which the agent starts when [remediation] enabled is set
(mscale.daemon.remediation wires it in). Off the cluster the Kubernetes client is never imported.

The optional dependencies (grpcio, protobuf, kubernetes: `pip install megascale-omni[kube]`)
are imported only by the service. May import: findings, options (the config machinery), tasks. Never
imports torch, nor mscale.daemon (the daemon imports this room).
"""
