#!/usr/bin/env bash
# The GPU machine's side of the GPU check (docs/engine.md, "The GPU check"): no network, no
# .venv, its own python3 (3.12, torch 2.11); what `make gpu-pack` packed here comes carried.
#   bash bench/gpu_box.sh stage     call 1: keeps SmolLM2's first part for call 2
#   bash bench/gpu_box.sh [ARGS]    call 2: installs the wheels into /tmp/site, joins SmolLM2,
#                                   runs bench/gpu_check.py ARGS, its files in $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == stage ]]; then
  mkdir -p .gpu-stage  # gitignored: the machine keeps it between calls while it stays warm
  cp .gpu-pack/smollm2-a/* .gpu-stage/
  ls -l .gpu-stage
  exit 0
fi
source bench/gpu_site.sh
smollm2=()
if python3 bench/gpu_pack.py join; then smollm2=(--smollm2 .gpu-models); fi
exec python3 bench/gpu_check.py --out "${OUT:-bench/gpu_check}" "${smollm2[@]}" "$@"
