"""`phasefleet router`: the OpenAI front door of a service, in front of its worker pools.

Workers come from `--workers URL,...` (a static list, local use) or, as the operator runs it,
from `--worker-service` (aggregated) or `--prefill-service` plus `--decode-service`
(disaggregated): `host:port` of a headless Service, read on every refresh from its EndpointSlices
(in a pod with a ServiceAccount token) or from DNS. Heavy imports (fastapi, uvicorn) happen
inside `run`.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from phasefleet.api.contract import INTERNAL_TOKEN_ENV, ROUTER_PORT, RouterFlag
from phasefleet.router.config import DEFAULT_MAX_ATTEMPTS, DEFAULT_REFRESH_INTERVAL, RouterConfig
from phasefleet.router.discovery import (
    Discovery,
    DnsDiscovery,
    FileDiscovery,
    StaticDiscovery,
    read_members,
)
from phasefleet.router.endpointslices import (
    SERVICEACCOUNT_DIR,
    EndpointSliceDiscovery,
    KubeAccess,
)
from phasefleet.router.hold import DEFAULT_HOLD_SECONDS, DEFAULT_MAX_HELD
from phasefleet.router.policy import POLICIES
from phasefleet.termination import fail, write_termination_message

PROGRAM = "phasefleet router"
GRACEFUL_SHUTDOWN_TIMEOUT = 25  # seconds open streams get after SIGTERM (grace period is 30)

logger = logging.getLogger("phasefleet.router")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(RouterFlag.SERVED_MODEL_NAME, required=True, help="the name clients send")
    parser.add_argument(
        RouterFlag.POLICY, default="least-loaded", choices=POLICIES, help="how a worker is picked"
    )
    pools = parser.add_argument_group(
        "workers",
        "one of: --workers, --workers-file, --worker-service, or --prefill-service with "
        "--decode-service",
    )
    pools.add_argument("--workers", default=None, help="static list: URL[,URL...]")
    pools.add_argument(
        "--workers-file",
        default=None,
        help='JSON {"worker": [URL...]} or {"prefill": [...], "decode": [...]}, re-read on '
        "every refresh (the local fleet's membership)",
    )
    pools.add_argument(
        RouterFlag.pool_service("worker"), default=None, help="aggregated pool: host:port"
    )
    pools.add_argument(
        RouterFlag.pool_service("prefill"), default=None, help="prefill pool: host:port"
    )
    pools.add_argument(
        RouterFlag.pool_service("decode"), default=None, help="decode pool: host:port"
    )
    pools.add_argument(
        "--discovery",
        default="auto",
        choices=("auto", "endpointslices", "dns"),
        help="how a --*-service is read: its EndpointSlices through the Kubernetes API, or DNS; "
        "auto: EndpointSlices when a ServiceAccount token is mounted, else DNS",
    )

    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0")
    server.add_argument(RouterFlag.PORT, type=int, default=ROUTER_PORT)
    server.add_argument(
        "--max-attempts",
        type=int,
        default=DEFAULT_MAX_ATTEMPTS,
        help="workers tried per request before giving up",
    )
    server.add_argument(
        "--refresh-interval",
        type=float,
        default=DEFAULT_REFRESH_INTERVAL,
        help="seconds between discovery and load polls",
    )
    server.add_argument(
        RouterFlag.HOLD_SECONDS,
        type=float,
        default=DEFAULT_HOLD_SECONDS,
        help="seconds a request waits for a ready worker in a pool that has none (scaled to "
        "zero, waking) before 503; 0: no holding",
    )
    server.add_argument(
        RouterFlag.MAX_HELD_REQUESTS,
        type=int,
        default=DEFAULT_MAX_HELD,
        help="requests held per pool at once; more get 503 at once",
    )
    server.add_argument(
        RouterFlag.LATE_AFTER_MS,
        type=int,
        default=None,
        help="the service's TTFT target, sent with every request: the workers serve prompts"
        " that waited past it after those that can still meet it (default: none, the workers'"
        " own --late-after-ms)",
    )
    server.add_argument(
        RouterFlag.TPOT_TARGET_MS,
        type=int,
        default=None,
        help="the service's TPOT target, sent with every request that names a prefill worker:"
        " a decode worker prefills locally only while its inter-token latency stays within it"
        " (default: none, the decode workers' own --tpot-target-ms)",
    )
    server.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))


def discoveries(args: argparse.Namespace) -> dict[str, Discovery]:
    """Pool name -> where its workers come from. ValueError unless the flags name exactly one
    layout: a static list, one aggregated Service, or a prefill and a decode Service. A Service
    is read through its EndpointSlices in a pod with a ServiceAccount token, else through DNS."""
    aggregated = [f for f in ("workers", "workers_file", "worker_service") if getattr(args, f)]
    split = [f for f in ("prefill_service", "decode_service") if getattr(args, f)]
    if len(aggregated) + bool(split) != 1 or (split and len(split) != 2):
        raise ValueError(
            "give exactly one of --workers, --workers-file, --worker-service, or both "
            "--prefill-service and --decode-service"
        )
    if args.workers_file:
        names = set(read_members(Path(args.workers_file)))
        if names not in ({"worker"}, {"prefill", "decode"}):
            raise ValueError(
                f"the workers file {args.workers_file} must name the pool worker, or prefill "
                f"and decode; it names {sorted(names)}"
            )
        return {name: FileDiscovery(args.workers_file, name) for name in sorted(names)}
    if args.workers:
        return {"worker": StaticDiscovery([u for u in args.workers.split(",") if u.strip()])}
    services = (
        {"worker": args.worker_service}
        if args.worker_service
        else {"prefill": args.prefill_service, "decode": args.decode_service}
    )
    access = None if args.discovery == "dns" else KubeAccess.in_cluster()
    if args.discovery == "endpointslices" and access is None:
        raise ValueError(
            "--discovery endpointslices needs KUBERNETES_SERVICE_HOST/PORT and a ServiceAccount "
            f"token at {SERVICEACCOUNT_DIR}/token"
        )
    if access is None:
        return {name: DnsDiscovery(address) for name, address in services.items()}
    return {name: EndpointSliceDiscovery(access, address) for name, address in services.items()}


def run(args: argparse.Namespace) -> int:
    from phasefleet.server.api_keys import ApiKeys

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per upstream request
    config = RouterConfig(
        served_model_name=args.served_model_name,
        policy=args.policy,
        max_attempts=args.max_attempts,
        refresh_interval=args.refresh_interval,
        internal_token=os.environ.get(INTERNAL_TOKEN_ENV) or None,
        hold_seconds=args.hold_seconds,
        max_held_requests=args.max_held_requests,
        late_after_ms=args.late_after_ms,
        tpot_target_ms=args.tpot_target_ms,
    )
    try:
        config.api_keys = ApiKeys.from_env(os.environ)
        config.validate()
        sources = discoveries(args)
    except ValueError as exc:
        return fail(PROGRAM, str(exc), code=2)
    return _serve(args, config, sources)


def _serve(args: argparse.Namespace, config: RouterConfig, sources: dict[str, Discovery]) -> int:
    import uvicorn

    from phasefleet.router.app import build_app
    from phasefleet.router.dispatch import Router
    from phasefleet.router.metrics import RouterMetrics
    from phasefleet.router.pool import WorkerPool
    from phasefleet.router.upstream import Upstream

    upstream = Upstream()
    pools = {name: WorkerPool(name, source, upstream) for name, source in sources.items()}
    router = Router(config, pools, upstream, RouterMetrics(config.served_model_name))
    uv_config = uvicorn.Config(
        build_app(router),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_TIMEOUT,
    )
    logger.info(
        "router for %s (policy %s) on %s:%d, pools: %s", config.served_model_name, config.policy,
        args.host, args.port, ", ".join(p.describe() for p in pools.values()),
    )  # fmt: skip
    try:
        uvicorn.Server(uv_config).run()
    except SystemExit as exc:  # uvicorn exits non-zero when it cannot start (e.g. listen)
        if exc.code not in (0, None):
            write_termination_message(
                f"could not serve on {args.host}:{args.port} (uvicorn exited {exc.code}): is"
                " the port taken, or not allowed? The log above says which"
            )
        raise
    return 0
