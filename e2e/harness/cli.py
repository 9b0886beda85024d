"""`make cluster-up` / `make cluster-down`: a control plane for people, left running between
commands. Its state (kubeconfig, logs, pids) lives in .cluster/ at the repository root.

    python -m e2e.harness.cli up      start, print the KUBECONFIG line to use
    python -m e2e.harness.cli down    stop every component, remove .cluster/
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from e2e.harness.controlplane import ControlPlane, tools_bin_dir
from e2e.harness.process import process_group_alive, stop_process_group

STATE_DIR = Path(__file__).resolve().parents[2] / ".cluster"
STATE_FILE = STATE_DIR / "state.json"


def up() -> int:
    if STATE_FILE.exists():
        print(f"a cluster is already up (state in {STATE_DIR}); run `make cluster-down` first")
        return 1
    started = time.monotonic()
    cluster = ControlPlane(workdir=STATE_DIR, bin_dir=tools_bin_dir())
    cluster.start()
    STATE_FILE.write_text(json.dumps({"pids": cluster.pids(), "server": cluster.server}))
    print(f"control plane ready in {time.monotonic() - started:.1f}s at {cluster.server}")
    print(f"logs: {cluster.logs_dir}")
    print(f"export KUBECONFIG={cluster.kubeconfig} PATH={cluster.bin_dir}:$PATH")
    return 0


def down() -> int:
    if not STATE_DIR.exists():
        print("no cluster is up")
        return 0
    pids = json.loads(STATE_FILE.read_text())["pids"] if STATE_FILE.exists() else []
    for pid in reversed(pids):
        stop_process_group(pid)
    leftover = [pid for pid in pids if process_group_alive(pid)]
    if leftover:
        print(f"processes still running: {leftover}", file=sys.stderr)
        return 1
    shutil.rmtree(STATE_DIR)
    print("control plane stopped and removed")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.harness.cli")
    parser.add_argument("action", choices=["up", "down"])
    args = parser.parse_args()
    return up() if args.action == "up" else down()


if __name__ == "__main__":
    sys.exit(main())
