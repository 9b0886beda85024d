"""A worker's start-up, broken down, and the weight loader before and after it loads in place.

For each model: (1) the weights alone, each loader in a fresh process, alternating: the loader
before this change (the whole checkpoint read into host memory, moved, cast, then q/k/v and
gate/up concatenated) against today's (each tensor read once and copied into its place); seconds
and the extra peak of host and device memory. (2) A real `phasefleet worker` started as a pod
starts it: wall time from spawn to /health, its own phases (phasefleet_worker_startup_seconds),
then the first request's latency against the median of the next three, with the CPU linear
plans' cache empty (a fresh pod) and then warm.

    .venv/bin/python bench/startup.py --models bench,smollm2            # CPU
    python3 bench/startup.py --device cuda --make-8b /tmp/llama3-8b     # GPU: a random 8B

Writes startup.json and startup.md to --out ($OUT, else bench/startup/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

BENCH = Path(__file__).resolve().parent
MIB = 2**20
PHASES_METRIC = "phasefleet_worker_startup_seconds"
READY_TIMEOUT_S = 300.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--models", default="bench,smollm2", help="bench, smollm2, or folders")
    p.add_argument("--make-8b", type=Path, help="write a random bf16 Llama-3-8B here and use it")
    p.add_argument("--quick", action="store_true", help="--make-8b writes two small layers")
    p.add_argument("--rounds", type=int, default=3, help="loads per loader, alternating (0: none)")
    p.add_argument("--cold-only", action="store_true", help="only the cold-disk worker starts")
    p.add_argument("--workers", type=int, default=2, help="worker start-ups per plan cache state")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or BENCH / "startup"))
    p.add_argument(
        "--load-only", nargs=3, metavar=("LOADER", "FOLDER", "DEVICE"), help=argparse.SUPPRESS
    )
    return p.parse_args()


# -- the loaders, in a process of their own ------------------------------------------------------


def old_load_model(folder: Path, config: Any, dtype: Any, device: Any, max_positions: int) -> Any:
    """The loader before loading in place: every file into host memory, assigned, moved and cast
    as a whole, then q/k/v and gate/up concatenated (the baseline, kept here only)."""
    import torch
    from safetensors.torch import load_file

    from phasefleet.engine.models.llama import CausalLM
    from phasefleet.engine.models.rope import rope_tables

    with torch.device("meta"):
        model = CausalLM(config)
    state: dict[str, Any] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    if model.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=True, assign=True)
    del state
    model = model.to(device=device, dtype=dtype).eval()
    model.fuse()
    model.fold_norms()
    cos, sin = rope_tables(config, max_positions)
    model.rope_cos, model.rope_sin = cos.to(device, dtype), sin.to(device, dtype)
    return model


class RssPeak:
    """The process's resident memory sampled every 5 ms from now: stop() gives its peak above
    the first sample, in bytes (ru_maxrss counts what the imports peaked at)."""

    def __init__(self) -> None:
        self.base = self.peak = self._rss()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    @staticmethod
    def _rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(self.peak, self._rss()) - self.base


def load_only(loader_name: str, folder: Path, device_name: str) -> None:
    """Prints {seconds, host_peak_mib, device_peak_gib} of one load (imports not counted)."""
    import torch
    from transformers import AutoConfig

    from phasefleet.engine.model_runner import resolve_dtype
    from phasefleet.engine.models.loader import load_model

    device = torch.device(device_name)
    config = AutoConfig.from_pretrained(folder)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        resolve_dtype("auto", getattr(config, "dtype", None), device)
    ]
    load = load_model if loader_name == "new" else old_load_model
    rss = RssPeak()
    if device.type == "cuda":
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    model = load(folder, config, dtype, device, 4096)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    out = {"seconds": seconds, "host_peak_mib": rss.stop() / MIB}
    if device.type == "cuda":
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        out["device_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["weights_gib"] = weights / 2**30
    print(json.dumps(out))


def time_loaders(folder: Path, device: str, rounds: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for _ in range(rounds):
        for name in ("old", "new"):
            cmd = [sys.executable, __file__, "--load-only", name, str(folder), device]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary: dict[str, Any] = {}
    for name, rows in runs.items():
        summary[name] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        summary[name]["runs"] = rows
    summary["speedup"] = summary["old"]["seconds"] / summary["new"]["seconds"]
    return summary


# -- a worker process, started as a pod starts it --------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def phases(base: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(PHASES_METRIC + "{"):
            labels, value = line.rsplit(" ", 1)
            phase = labels.split('phase="')[1].split('"')[0]
            out[phase] = float(value)
    return out


def request_seconds(base: str, model: str) -> float:
    """Seconds of one 16-token greedy completion of a short prompt."""
    body = {"model": model, "prompt": "The history of", "max_tokens": 16, "temperature": 0}
    started = time.perf_counter()
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return time.perf_counter() - started


def drop_page_cache() -> bool:
    """Empties the kernel's page cache (root only): the next start reads from the disk."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def start_worker(folder: Path, device: str, env_extra: dict[str, str], log: Path) -> dict[str, Any]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, **env_extra, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "phasefleet.cli", "worker", "--model", str(folder)]
    cmd += ["--device", device, "--port", str(port), "--served-model-name", "m"]
    cmd += ["--max-model-len", "2048"]
    started = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        while True:
            if time.perf_counter() - started > READY_TIMEOUT_S:
                raise RuntimeError(f"no /health in {READY_TIMEOUT_S} s: {log.read_text()[-2000:]}")
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the worker exited {proc.returncode}: {log.read_text()[-2000:]}"
                )
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - started
        first = request_seconds(base, "m")
        later = statistics.median(request_seconds(base, "m") for _ in range(3))
        return {"ready_s": ready, "phases": phases(base), "first_s": first, "later_s": later}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


# (label, drop the page cache first, fresh CPU linear plans, read the weights ahead)
STARTS = {
    "cpu": [
        ("fresh plans", False, True, True),
        ("warm", False, False, True),
        ("cold disk, no read-ahead", True, False, False),
        ("cold disk, read-ahead", True, False, True),
    ],
    "cuda": [
        ("warm", False, False, True),
        ("cold disk, no read-ahead", True, False, False),
        ("cold disk, read-ahead", True, False, True),
    ],
}


def time_worker(
    folder: Path, device: str, starts: int, scratch: Path, cold_only: bool = False
) -> dict[str, Any]:
    """Each kind of start `starts` times, interleaved; a cold disk only where the page cache
    can be dropped (root)."""
    plans = scratch / f"plans-{folder.name}.json"
    kinds = [k for k in STARTS[device] if k[1] or not cold_only]
    out: dict[str, Any] = {label: [] for label, *_ in kinds}
    for i in range(starts):
        for label, cold, fresh_plans, ahead in kinds:
            if fresh_plans:
                plans.unlink(missing_ok=True)
            if cold and not drop_page_cache():
                out.pop(label, None)
                continue
            env = {
                "PHASEFLEET_CPU_LINEAR_CACHE": str(plans),
                "PHASEFLEET_WEIGHT_PREFETCH": "1" if ahead else "0",
            }
            log = scratch / f"{folder.name}-{label.replace(' ', '_')}-{i}.log"
            out[label].append(start_worker(folder, device, env, log))
    return out


# -- models ------------------------------------------------------------------------------------


def model_folder(name: str, scratch: Path) -> Path:
    if name == "bench":
        folder = scratch / "bench-model"
        if not (folder / "config.json").is_file():
            from phasefleet.engine.tiny import make_tiny

            make_tiny(folder, preset="bench")
        return folder
    if name == "smollm2":
        from phasefleet.server.named_models import named_model_folder

        made = named_model_folder("smollm2")
        if made is None:
            raise SystemExit("no SmolLM2 here: `make smollm2` (or PHASEFLEET_CACHE)")
        return Path(made)
    return Path(name)


def make_random_8b(folder: Path, device: str, quick: bool) -> Path:
    """Llama 3 8B's shapes in bfloat16, random, as 5 safetensors shards (as published)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    if any(folder.glob("model-*.safetensors")):
        return folder
    sys.path.insert(0, str(BENCH))
    from gpu_models import llama3_8b_config
    from gpu_report import CheckContext

    from phasefleet.engine.models.llama import CausalLM

    ctx = CheckContext(device=device, quick=quick, work=folder.parent, smollm2_cache=None)
    made = llama3_8b_config(ctx)
    (made / "model.safetensors").unlink(missing_ok=True)
    if made != folder:
        made.rename(folder)
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in CausalLM(config).state_dict().items()}
    gen = torch.Generator(device=device).manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    size, index = 0, 0

    def flush() -> None:
        nonlocal shard, size, index
        index += 1
        save_file(shard, str(folder / f"model-{index:05d}-of-00005.safetensors"))
        shard, size = {}, 0

    for name, shape in shapes.items():
        t = torch.randn(shape, dtype=torch.bfloat16, device=device, generator=gen).mul_(0.02)
        shard[name] = t.cpu()
        size += t.numel() * 2
        if size >= 3.5 * 2**30:
            flush()
    if shard:
        flush()
    return folder


def report(results: dict[str, Any]) -> str:
    lines = [
        f"# Worker start-up ({results['device']})",
        "",
        f"`{results['command']}`, {results['date']}",
        "",
    ]
    lines += [
        "| model | loader | load s | host peak MiB | device peak GiB |",
        "|---|---|---|---|---|",
    ]
    for name, r in results["models"].items():
        if not r["weights"]:
            continue
        for loader_name in ("old", "new"):
            x = r["weights"][loader_name]
            lines.append(
                f"| {name} | {loader_name} | {x['seconds']:.2f} | {x['host_peak_mib']:.0f} | "
                f"{x.get('device_peak_gib', 0):.1f} |"
            )
    lines += ["", "| model | start | ready s | phases | first request s | later s |"]
    lines += ["|---|---|---|---|---|---|"]
    for name, r in results["models"].items():
        for state, rows in r["worker"].items():
            for row in rows:
                ph = ", ".join(f"{k} {v:.2f}" for k, v in row["phases"].items())
                lines.append(
                    f"| {name} | {state} | {row['ready_s']:.2f} | {ph} | {row['first_s']:.3f} | "
                    f"{row['later_s']:.3f} |"
                )
    return "\n".join(lines) + "\n"


def main() -> int:
    args = parse_args()
    if args.load_only:
        loader_name, folder, device = args.load_only
        load_only(loader_name, Path(folder), device)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="pf-startup-"))
    names = [str(args.make_8b)] if args.make_8b else args.models.split(",")
    results: dict[str, Any] = {
        "device": args.device,
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "models": {},
    }
    for name in names:
        if args.make_8b:
            t = time.perf_counter()
            folder = make_random_8b(args.make_8b, args.device, args.quick)
            print(f"wrote {folder} in {time.perf_counter() - t:.1f} s", flush=True)
        else:
            folder = model_folder(name, scratch)
        entry: dict[str, Any] = {"folder": str(folder)}
        entry["weights"] = time_loaders(folder, args.device, args.rounds) if args.rounds else {}
        print(name, "weights", json.dumps(entry["weights"]), flush=True)
        (args.out / "startup.json").write_text(json.dumps({**results, name: entry}, indent=1))
        entry["worker"] = time_worker(folder, args.device, args.workers, scratch, args.cold_only)
        results["models"][Path(name).name] = entry
        (args.out / "startup.json").write_text(json.dumps(results, indent=1))
        (args.out / "startup.md").write_text(report(results))
        print(report(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
