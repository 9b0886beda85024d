"""`phasefleet worker`: one engine worker serving the OpenAI API over HTTP.

Heavy imports (torch, transformers, fastapi) happen inside `run`, so `phasefleet --help` stays
fast and works without them.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from phasefleet.api.boundary import (
    DEFAULT_BUSY_BACKLOG_S,
    DEFAULT_IDLE_MIN_TOKENS,
    DEFAULT_LOCAL_MAX_TOKENS,
    PhaseBoundary,
)
from phasefleet.api.contract import (
    DEFAULT_LATE_LIMIT_S,
    DEFAULT_REMOTE_PREFILL_MIN_TOKENS,
    INTERNAL_TOKEN_ENV,
    KV_CACHE_DTYPES,
    SCHEDULING_POLICIES,
    WORKER_PORT,
    EngineRole,
    WorkerFlag,
)
from phasefleet.engine.config import DEVICES, DTYPES, EngineConfig  # a dataclass: no torch
from phasefleet.engine.startup import StartupTimes  # no torch
from phasefleet.engine.tokenizer import GENERATION_CONFIG_FILE  # no heavy imports
from phasefleet.server.adapters import parse_lora_modules  # no heavy imports
from phasefleet.server.api_keys import ApiKeys  # no heavy imports
from phasefleet.server.async_engine import DEFAULT_STALL_TIMEOUT  # no heavy imports
from phasefleet.server.pooling import Pooling
from phasefleet.server.reasoning import REASONING_PARSERS  # no heavy imports
from phasefleet.server.sampling_defaults import GENERATION_CONFIGS, SamplingDefaults
from phasefleet.server.tool_parsers import TOOL_CALL_PARSERS  # no heavy imports
from phasefleet.termination import fail, write_termination_message

DEFAULT_MAX_QUEUE_LEN = 256  # requests waiting to be scheduled before new ones get 429
DEFAULT_DRAIN_TIMEOUT = 25.0  # seconds; under Kubernetes' default 30 s grace period
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20  # request bodies larger than this get 413
GRACEFUL_SHUTDOWN_TIMEOUT = 5.0  # seconds uvicorn waits for open connections after a drain

PROGRAM = "phasefleet worker"  # how its messages on stderr begin

logger = logging.getLogger("phasefleet.worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model")
    model.add_argument(
        WorkerFlag.MODEL,
        required=True,
        help="Hugging Face model folder, a .gguf file (or a folder holding one), a short name"
        " (smollm2, tiny), or a Hub repo id (org/name) when no such folder exists",
    )
    model.add_argument(
        "--revision",
        default=os.environ.get("HF_REVISION") or None,
        help="with a repo id: branch, tag or commit (default: $HF_REVISION, else main)",
    )
    model.add_argument(
        WorkerFlag.SERVED_MODEL_NAME,
        default=None,
        help="the name clients send as `model` (default: the --model value)",
    )
    model.add_argument(
        WorkerFlag.DTYPE,
        default="auto",
        choices=DTYPES,
        help="auto: float32 on CPU; on CUDA the checkpoint's 16-bit dtype, else bfloat16",
    )
    model.add_argument("--device", default="auto", choices=DEVICES)
    model.add_argument(
        WorkerFlag.TENSOR_PARALLEL_SIZE,
        type=int,
        default=1,
        help="ranks the model is split over, one process and device each (divides the heads)",
    )
    model.add_argument(
        WorkerFlag.MAX_MODEL_LEN, type=int, default=None, help="tokens, prompt plus output"
    )

    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument(
        WorkerFlag.LORA_MODULES,
        nargs="+",
        default=[],
        metavar="NAME=SOURCE",
        help="LoRA adapters of this model, served under NAME (a request's `model`): a PEFT\n"
        "adapter folder, or a Hugging Face repo id org/name[@revision] (fetched at start)",
    )
    lora.add_argument(
        WorkerFlag.MAX_LORAS,
        type=int,
        default=None,
        help="adapter slots on the device (default: one per --lora-modules entry)",
    )
    lora.add_argument(
        WorkerFlag.MAX_LORA_RANK, type=int, default=16, help="the largest adapter rank"
    )
    lora.add_argument(
        WorkerFlag.ENABLE_RUNTIME_LORA,
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (into the free\n"
        "slots of --max-loras)",
    )

    engine = parser.add_argument_group("engine")
    engine.add_argument(
        WorkerFlag.ROLE,
        default=EngineRole.BOTH.value,
        choices=[role.value for role in EngineRole],
        help="this worker's phase (the `role` label of its metrics)",
    )
    engine.add_argument(WorkerFlag.MAX_NUM_SEQS, type=int, default=64, help="requests in one batch")
    engine.add_argument(
        WorkerFlag.MAX_NUM_BATCHED_TOKENS, type=int, default=2048, help="token budget of one step"
    )
    engine.add_argument(
        "--num-kv-blocks", type=int, default=None, help="KV blocks (default: sized from memory)"
    )
    engine.add_argument(WorkerFlag.BLOCK_SIZE, type=int, default=16, help="tokens per KV block")
    engine.add_argument(
        WorkerFlag.KV_CACHE_DTYPE,
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="KV cache element type: auto (the model's dtype) or fp8 (float8 e4m3, unscaled: "
        "twice the blocks of a 16-bit pool)",
    )
    engine.add_argument(
        WorkerFlag.NO_PREFIX_CACHING, action="store_true", help="disable prefix caching"
    )
    engine.add_argument(
        WorkerFlag.HOST_KV_CACHE_GIB,
        type=float,
        default=0.0,
        help="host memory (GiB) for the prefix cache's second tier: blocks the KV pool evicts "
        "are kept there and loaded back for a prompt that starts with them (default 0: off)",
    )
    engine.add_argument(
        WorkerFlag.LATE_AFTER_MS,
        type=float,
        default=None,
        help="the service's TTFT target: a prompt that has waited longer goes behind those\n"
        "that have not (late prompts last); unset: first come, first served",
    )
    engine.add_argument(
        WorkerFlag.LATE_LIMIT_S,
        type=float,
        default=DEFAULT_LATE_LIMIT_S,
        help="seconds after which a late prompt is served in its turn again",
    )
    engine.add_argument(
        WorkerFlag.SCHEDULING_POLICY,
        choices=SCHEDULING_POLICIES,
        default="fcfs",
        help="fcfs: first come, first served (late prompts last); priority: by each request's\n"
        "`priority`, lower first (a priority is a 400 under fcfs)",
    )
    engine.add_argument(
        WorkerFlag.NUM_SPECULATIVE_TOKENS,
        type=int,
        default=EngineConfig.num_speculative_tokens,
        help="speculative decoding: tokens a request guesses from its own context\n"
        "(prompt lookup) and verifies per step; 0: off",
    )
    engine.add_argument(
        WorkerFlag.PROMPT_LOOKUP_MIN,
        type=int,
        default=EngineConfig.prompt_lookup_min,
        help="shortest n-gram looked up",
    )
    engine.add_argument(
        WorkerFlag.PROMPT_LOOKUP_MAX,
        type=int,
        default=EngineConfig.prompt_lookup_max,
        help="longest n-gram looked up",
    )

    server = parser.add_argument_group("server")
    server.add_argument("--host", default="0.0.0.0")
    server.add_argument(WorkerFlag.PORT, type=int, default=WORKER_PORT)
    server.add_argument(
        "--max-queue-len",
        type=int,
        default=DEFAULT_MAX_QUEUE_LEN,
        help="requests waiting to be scheduled; more are answered 429 with Retry-After",
    )
    server.add_argument(
        WorkerFlag.DRAIN_TIMEOUT,
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    server.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body in bytes; a larger one is answered 413",
    )
    server.add_argument(
        "--stall-timeout",
        type=float,
        default=DEFAULT_STALL_TIMEOUT,
        help="seconds one engine step may run before /health/live reports the engine stalled",
    )
    server.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))
    server.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="the model's format of tool calls in free text, for chat's tool_choice 'auto': "
        "hermes (<tool_call>{...}</tool_call>, as Hermes and Qwen2.5) or llama3_json (an answer "
        "of JSON calls, as Llama 3.1-3.3); without it 'auto' is a 400",
    )
    server.add_argument(
        "--generation-config",
        choices=GENERATION_CONFIGS,
        default="auto",
        help="defaults for the sampling fields a request leaves out (temperature, top_p, top_k, "
        "min_p, repetition_penalty): auto, the model's generation_config.json where it sets them "
        "(as vLLM); vllm, the OpenAI API's (temperature 1, no cuts)",
    )
    server.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="return a reasoning model's thought (up to </think>) as a chat answer's "
        "reasoning_content: qwen3 (the model opens <think> itself) or deepseek_r1 (the template "
        "opens it: DeepSeek-R1, QwQ, Qwen3 Thinking-2507); without it the thought is content",
    )

    handoff = parser.add_argument_group(
        "KV hand-off",
        f"/internal/* and remote prefill need the internal token in ${INTERNAL_TOKEN_ENV}",
    )
    handoff.add_argument(
        WorkerFlag.KV_LEASE_SECONDS,
        type=float,
        default=30.0,
        help="prefill role: seconds a finished prefill keeps its KV for the decode worker",
    )
    handoff.add_argument(
        WorkerFlag.REMOTE_PREFILL_MIN_TOKENS,
        type=int,
        default=DEFAULT_REMOTE_PREFILL_MIN_TOKENS,
        help="decode role: prompts with fewer uncached tokens are prefilled here, not remotely;\n"
        "0: every prompt is handed off, whatever the load",
    )
    handoff.add_argument(
        WorkerFlag.ADAPTIVE_PHASE_BOUNDARY,
        action="store_true",
        help="decode role: move the threshold with the load (the prefill worker's backlog,\n"
        "this worker's own prefill and TPOT); off: the threshold alone decides",
    )
    handoff.add_argument(
        WorkerFlag.BOUNDARY_BUSY_BACKLOG_MS,
        type=float,
        default=DEFAULT_BUSY_BACKLOG_S * 1000,
        help="decode role: a prefill worker this far behind (ms of its throughput) gets no\n"
        "prompt this worker has room to prefill itself",
    )
    handoff.add_argument(
        WorkerFlag.BOUNDARY_IDLE_MIN_TOKENS,
        type=int,
        default=DEFAULT_IDLE_MIN_TOKENS,
        help="decode role: while the prefill worker is idle, prompts from this many uncached\n"
        "tokens are prefilled there",
    )
    handoff.add_argument(
        WorkerFlag.BOUNDARY_LOCAL_MAX_TOKENS,
        type=int,
        default=DEFAULT_LOCAL_MAX_TOKENS,
        help="decode role: prompt tokens this worker holds unprefilled, at most, when it takes\n"
        "a prompt the threshold would hand off",
    )
    handoff.add_argument(
        WorkerFlag.TPOT_TARGET_MS,
        type=float,
        help="decode role: the service's TPOT target; no local prefill is taken on while the\n"
        "recent inter-token latency is over 0.8 of it",
    )


def import_serving() -> None:
    """What serving needs and takes seconds to import (torch, transformers, the server), at once:
    the start-up's imports phase."""
    import torch  # noqa: F401
    import uvicorn  # noqa: F401

    import phasefleet.engine.llm_engine  # noqa: F401
    import phasefleet.server.app  # noqa: F401


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from phasefleet.server import prefetch

    prefetch.start(args.model, args.revision)  # overlaps the imports below
    startup = StartupTimes()
    with startup.phase("imports"):
        import_serving()
    try:
        adapters = parse_lora_modules(args.lora_modules, args.served_model_name)
    except ValueError as exc:
        return fail(PROGRAM, str(exc), code=2)
    config = EngineConfig(
        model=args.model,
        lora_adapters=adapters,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        dtype=args.dtype,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        num_kv_blocks=args.num_kv_blocks,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=not args.no_prefix_caching,
        host_kv_cache_gib=args.host_kv_cache_gib,
        kv_lease_seconds=args.kv_lease_seconds,
        late_after_s=None if args.late_after_ms is None else args.late_after_ms / 1000,
        late_limit_s=args.late_limit_s,
        scheduling_policy=args.scheduling_policy,
        num_speculative_tokens=args.num_speculative_tokens,
        prompt_lookup_min=args.prompt_lookup_min,
        prompt_lookup_max=args.prompt_lookup_max,
    )
    try:
        config.validate()
        if args.enable_runtime_lora and not config.num_lora_slots:
            raise ValueError("--enable-runtime-lora needs adapter slots: set --max-loras")
        if args.max_queue_len < 1:
            raise ValueError(f"max_queue_len must be >= 1, got {args.max_queue_len}")
        if args.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {args.max_request_bytes}")
        if args.remote_prefill_min_tokens < 0:
            raise ValueError(
                f"remote_prefill_min_tokens must be >= 0, got {args.remote_prefill_min_tokens}"
            )
        if not args.boundary_busy_backlog_ms > 0:
            raise ValueError(
                f"boundary_busy_backlog_ms must be > 0, got {args.boundary_busy_backlog_ms}"
            )
        for name in ("boundary_idle_min_tokens", "boundary_local_max_tokens"):
            if getattr(args, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(args, name)}")
        args.phase_boundary = PhaseBoundary(  # for _serve
            min_tokens=args.remote_prefill_min_tokens,
            adaptive=args.adaptive_phase_boundary,
            busy_backlog_s=args.boundary_busy_backlog_ms / 1000,
            idle_min_tokens=args.boundary_idle_min_tokens,
            local_max_tokens=args.boundary_local_max_tokens,
        )
        if args.tpot_target_ms is not None and not args.tpot_target_ms > 0:
            raise ValueError(f"tpot_target_ms must be > 0, got {args.tpot_target_ms}")
        if not args.stall_timeout > 0:
            raise ValueError(f"stall_timeout must be > 0 seconds, got {args.stall_timeout}")
        dtype = engine_dtype(args.dtype, args.device)
        keys = ApiKeys.from_env(os.environ)
    except ValueError as exc:
        return fail(PROGRAM, str(exc), code=2)
    from phasefleet.server.adapters import resolve_adapters
    from phasefleet.server.model_source import ModelFetchError, resolve_model, served_name

    try:  # settings first: a bad flag is not found out after a long download or conversion
        with startup.phase("model_fetch"):
            folder = resolve_model(args.model, args.revision, dtype)  # a folder: as is, or made
        if config.lora_adapters:
            with startup.phase("lora_fetch"):
                config.lora_adapters = resolve_adapters(config.lora_adapters)
    except ModelFetchError as exc:
        return fail(PROGRAM, str(exc))
    args.served_model_name = args.served_model_name or served_name(args.model, folder)
    args.model = config.model = folder
    try:
        model_folder_problem(args.model)
    except ValueError as exc:
        return fail(PROGRAM, str(exc), code=2)
    try:
        return _serve(args, config, startup, keys)
    except Exception as exc:  # anything before serving: its one line goes where Kubernetes reads
        write_termination_message(engine_failure(args.model, exc, loaded=False))
        raise


def engine_dtype(dtype: str, device: str) -> str:
    """The dtype the engine will run (and a GGUF model is converted to): `auto` is float32 on
    CPU, bfloat16 (or float16) on CUDA. Raises ValueError for cuda without a GPU."""
    from phasefleet.engine.model_runner import resolve_device, resolve_dtype

    return resolve_dtype(dtype, None, resolve_device(device))


def model_folder_problem(model: str) -> None:
    """Raises ValueError naming the fix when `model` is not a Hugging Face model folder."""
    folder = Path(model)
    if not folder.is_dir():
        raise ValueError(
            f"model folder {model} does not exist: put the model there, or point"
            " spec.model (image.path, pvc.path) or --model at a folder with config.json"
        )
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"model folder {model} has no config.json: it must be a Hugging Face model folder"
            " (config.json, tokenizer files, *.safetensors); fix spec.model or --model"
        )


OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory")


def out_of_memory(exc: BaseException) -> bool:
    """MemoryError, torch.OutOfMemoryError (CUDA), or the CPU allocator's RuntimeError."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return any(text in str(exc).lower() for text in OOM_TEXT)


def engine_failure(model: str, exc: BaseException, loaded: bool) -> str:
    """The worker's fatal error as one sentence: what failed and what to change."""
    cause = " ".join(f"{type(exc).__name__}: {exc}".split())[:400]
    if out_of_memory(exc):
        split = (
            ""
            if loaded
            else ", or split the model over more GPUs (tensorParallelSize; an FP8 checkpoint"
            " takes its bfloat16 size, twice its files, once loaded)"
        )
        return (
            f"out of memory {'serving' if loaded else 'loading'} model {model} ({cause}): give"
            " the pod more memory or a larger GPU (spec resources), or lower --num-kv-blocks,"
            f" maxModelLen or maxNumSeqs, or use a smaller dtype{split}"
        )
    if loaded:
        return f"the engine failed while serving model {model} ({cause}); see the pod's log"
    if "LoRA adapter" in str(exc):
        return f"model {model} cannot serve its LoRA adapters ({cause}): fix --lora-modules"
    if "tensor_parallel_size" in str(exc) or "tensor-parallel rank" in str(exc):
        return (
            f"model {model} cannot be split as asked ({cause}): set tensorParallelSize"
            " (--tensor-parallel-size) to a divisor of the model's attention heads, with one GPU"
            " per rank on the node"
        )
    return (
        f"the engine could not load model {model} ({cause}): check that the folder holds a"
        " complete Hugging Face model (config.json, tokenizer, *.safetensors) and spec.model"
    )


def _serve(
    args: argparse.Namespace, config: EngineConfig, startup: StartupTimes, keys: ApiKeys
) -> int:
    import uvicorn

    from phasefleet.engine.grammar import GrammarCompiler
    from phasefleet.engine.llm_engine import LLMEngine
    from phasefleet.engine.models.traits import load_decoder_config
    from phasefleet.engine.tokenizer import eos_token_ids, load_tokenizer
    from phasefleet.server.app import build_app
    from phasefleet.server.async_engine import AsyncEngine
    from phasefleet.server.drain import DrainingServer
    from phasefleet.server.handoff import HandoffClient
    from phasefleet.server.metrics import WorkerMetrics
    from phasefleet.server.reasoning import thought_end_ids
    from phasefleet.server.state import WorkerState

    served_name = args.served_model_name or args.model
    server: DrainingServer | None = None

    def on_fatal(exc: BaseException) -> None:
        logger.critical("the engine is broken (%r); exiting", exc)
        if server is not None:
            server.should_exit = True

    token = os.environ.get(INTERNAL_TOKEN_ENV) or None
    if token is None:
        logger.warning(
            "no $%s: /internal/* is refused and no prompt is prefilled remotely", INTERNAL_TOKEN_ENV
        )
    tokenizer = load_tokenizer(args.model)
    hf_config = load_decoder_config(args.model)
    vocab_size = int(hf_config.vocab_size)
    eos = eos_token_ids(args.model, hf_config, tokenizer)
    defaults = SamplingDefaults()
    if args.generation_config == "auto":
        defaults = SamplingDefaults.of_model(args.model)
        if defaults.overridden():
            logger.info("sampling defaults from the model's %s: %s", GENERATION_CONFIG_FILE,
                        defaults.overridden())  # fmt: skip
    pooling = Pooling.of_model(args.model, int(hf_config.hidden_size))
    grammars = GrammarCompiler(tokenizer, vocab_size, eos)
    engine = AsyncEngine(
        lambda: LLMEngine(config, startup=startup, grammars=grammars),
        args.max_queue_len,
        on_fatal,
        stall_timeout=args.stall_timeout,
    )
    state = WorkerState(
        engine=engine,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        grammars=grammars,
        served_model_name=served_name,
        role=args.role,
        metrics=WorkerMetrics(served_name, args.role, engine.stats, startup.seconds),
        max_request_bytes=args.max_request_bytes,
        internal_token=token,
        handoff=None if token is None else HandoffClient(token),
        boundary=args.phase_boundary,
        tpot_target_s=args.tpot_target_ms / 1000 if args.tpot_target_ms else None,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        thought_end_ids=thought_end_ids(tokenizer) if args.reasoning_parser else (),
        sampling_defaults=defaults,
        pooling=pooling,
        scheduling_policy=config.scheduling_policy,
        lora_names=tuple(config.lora_adapters),
        runtime_lora=args.enable_runtime_lora,
        api_keys=keys,
    )
    uv_config = uvicorn.Config(
        build_app(state),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_TIMEOUT),
    )
    server = DrainingServer(uv_config, state, args.drain_timeout)
    logger.info(
        "worker %s (role %s) on %s:%d, loading %s", served_name, args.role, args.host, args.port,
        args.model,
    )  # fmt: skip
    server.run()
    if engine.fatal_error is not None:
        return fail(PROGRAM, engine_failure(args.model, engine.fatal_error, loaded=engine.ready))
    return 0
