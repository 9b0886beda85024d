#!/usr/bin/env bash
# bash bench/gpu_fleet.sh on a lent GPU (carry .gpu-pack/wheels from `make gpu-pack`), as one
# device call: engine tests on CUDA beside writing the random 8B, then (alone) the 8B
# worker's start-up phases and late prompts last on an 8B worker.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?the device machine sets OUT, the folder whose files come back}"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
source bench/gpu_site.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
el installed
( timeout 215 python3 bench/gpu_check.py --out "$OUT/check" --checks engine_tests,cuda_graphs --budget 205 > "$OUT/check.log" 2>&1; echo "check rc=$?" >> "$OUT/check.log" ) &
CHECK=$!
timeout 150 python3 bench/startup.py --device cuda --make-8b /dev/shm/llama3-8b --rounds 0 --workers 0 --out "$OUT/make8b" > "$OUT/make8b.log" 2>&1; el "make8b rc=$?"
wait $CHECK; el "check done"; tail -25 "$OUT/check.log"
timeout 170 python3 bench/late_fleet.py --model /dev/shm/llama3-8b --prompt 2048 --max-tokens 4 --ttft-ms 1000 --burst-s 15 > "$OUT/late.log" 2>&1; el "late rc=$?"; tail -15 "$OUT/late.log"
timeout 100 python3 bench/startup.py --device cuda --models /dev/shm/llama3-8b --rounds 0 --workers 1 --out "$OUT/startup" > "$OUT/startup.log" 2>&1; el "startup rc=$?"; tail -12 "$OUT/startup.log"
