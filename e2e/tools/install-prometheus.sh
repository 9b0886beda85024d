#!/usr/bin/env bash
# Installs the Prometheus server from Debian's packages (the binary is started directly by
# the e2e harness; no systemd is needed). No-op when it is already there.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
[[ $(id -u) -eq 0 ]] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -q --no-install-recommends prometheus >/dev/null
# The package's post-install may try to start a system service; we run our own instances.
$SUDO pkill -x prometheus 2>/dev/null || true
command -v prometheus
