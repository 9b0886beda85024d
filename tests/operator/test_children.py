"""Child builders: names, ownership, pod templates, security, model sources, replicas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from phasefleet.api.contract import CHILD_KINDS, CPU_LINEAR_CACHE_ENV, WorkerFlag
from phasefleet.api.spec import OPERATOR_ENV, Role
from phasefleet.operator.children import (
    desired_children,
    endpoint,
    internal_token_secret,
    key,
    pool_replicas,
)
from phasefleet.operator.meta import ISVC_LABEL, ROLE_LABEL, SPEC_HASH_ANNOTATION
from phasefleet.operator.workloads import router_deployment, worker_deployment
from tests.operator.factories import make_owner, make_spec


def _by_key(children: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {key(c): c for c in children}


def _pod(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]


def test_disaggregated_children_and_names():
    children = _by_key(desired_children(make_owner(), make_spec()))
    expected = {
        (child.kind, name)
        for child in CHILD_KINDS
        for name in child.names("llm", ["prefill", "decode"])
    }
    assert set(children) == expected
    assert len(expected) == 12  # 3 per pool and router, plus the router's account, role, binding
    assert children[("Service", "llm-prefill")]["spec"]["clusterIP"] == "None"
    assert children[("Service", "llm-router")]["spec"]["ports"][0]["port"] == 80
    assert endpoint(make_owner()) == "http://llm-router.team-a.svc:80"


def test_router_reads_endpointslices_under_its_own_account_only() -> None:
    children = _by_key(desired_children(make_owner(), make_spec()))
    (rule,) = children[("Role", "llm-router")]["rules"]
    assert rule == {
        "apiGroups": ["discovery.k8s.io"],
        "resources": ["endpointslices"],
        "verbs": ["get", "list", "watch"],
    }
    binding = children[("RoleBinding", "llm-router")]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "llm-router", "namespace": "team-a"}
    ]
    assert binding["roleRef"]["name"] == "llm-router"
    router = _pod(children[("Deployment", "llm-router")])
    assert router["serviceAccountName"] == "llm-router"
    assert router["automountServiceAccountToken"] is True
    for role in ("prefill", "decode"):  # workers talk to no API: no token at all
        pod = _pod(children[("Deployment", f"llm-{role}")])
        assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod


def test_router_and_workers_get_the_internal_token_from_the_secret() -> None:
    children = _by_key(desired_children(make_owner(), make_spec()))
    want = {
        "name": "PHASEFLEET_INTERNAL_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "llm-internal", "key": "token"}},
    }
    for role in ("prefill", "decode", "router"):
        env = _pod(children[("Deployment", f"llm-{role}")])["containers"][0]["env"]
        assert want in env, role
    secret = internal_token_secret(make_owner())
    assert secret["metadata"]["name"] == "llm-internal"
    assert len(secret["stringData"]["token"]) >= 32
    assert internal_token_secret(make_owner())["stringData"] != secret["stringData"]  # random


def test_api_keys_reach_the_router_and_every_worker_as_a_mounted_secret() -> None:
    """The Secret's key is a read-only file in each pod (the kubelet keeps it up to date, the
    processes re-read it: rotation without a restart), named by $PHASEFLEET_API_KEY_FILE; the
    value itself is never in a pod spec."""
    spec = make_spec(auth={"apiKeySecret": {"name": "llm-keys", "key": "keys"}})
    children = _by_key(desired_children(make_owner(), spec))
    env_var = {"name": "PHASEFLEET_API_KEY_FILE", "value": "/etc/phasefleet/api-keys/keys"}
    volume = {
        "name": "api-keys",
        "secret": {"secretName": "llm-keys", "items": [{"key": "keys", "path": "keys"}]},
    }
    mount = {"name": "api-keys", "mountPath": "/etc/phasefleet/api-keys", "readOnly": True}
    for role in ("prefill", "decode", "router"):
        pod = _pod(children[("Deployment", f"llm-{role}")])
        container = pod["containers"][0]
        assert env_var in container["env"] and volume in pod["volumes"], role
        assert mount in container["volumeMounts"], role
        assert "PHASEFLEET_API_KEY" not in {e["name"] for e in container["env"]}
    for role in ("prefill", "decode", "router"):  # none without spec.auth
        pod = _pod(
            _by_key(desired_children(make_owner(), make_spec()))[("Deployment", f"llm-{role}")]
        )
        names = {e["name"] for e in pod["containers"][0]["env"]}
        assert not names & {"PHASEFLEET_API_KEY", "PHASEFLEET_API_KEY_FILE"}
        assert "api-keys" not in {v["name"] for v in pod["volumes"]}


def test_aggregated_has_one_worker_pool():
    spec = make_spec(mode="aggregated", prefill=None, decode=None, worker={"replicas": 3})
    children = _by_key(desired_children(make_owner(), spec))
    names = {name for _, name in children}
    assert names == {"llm-worker", "llm-router"}
    args = children[("Deployment", "llm-worker")]["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    assert args[args.index("--role") + 1] == "both"
    assert children[("Deployment", "llm-worker")]["spec"]["replicas"] == 3


def test_every_child_is_owned_and_labelled():
    for child in desired_children(make_owner(), make_spec()):
        meta = child["metadata"]
        assert meta["namespace"] == "team-a"
        (ref,) = meta["ownerReferences"]
        assert ref["uid"] == "uid-llm" and ref["controller"] is True
        assert ref["kind"] == "InferenceService"
        assert meta["labels"][ISVC_LABEL] == "llm"


def test_worker_pod_template():
    spec = make_spec(
        prefill={
            "replicas": 1,
            "terminationGracePeriodSeconds": 90,
            "maxNumBatchedTokens": 4096,
            "tensorParallelSize": 2,
            "resources": {"limits": {"nvidia.com/gpu": 2, "memory": "16Gi"}},
            "nodeSelector": {"phasefleet.dev/accelerator": "nvidia-gpu"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
            "affinity": {"nodeAffinity": {"x": 1}},
        }
    )
    dep = worker_deployment(make_owner(), spec, Role.PREFILL, replicas=1)
    template = dep["spec"]["template"]
    pod = template["spec"]
    (container,) = pod["containers"]
    assert template["metadata"]["labels"][ROLE_LABEL] == "prefill"
    assert dep["spec"]["selector"]["matchLabels"] == {ISVC_LABEL: "llm", ROLE_LABEL: "prefill"}
    annotations = template["metadata"]["annotations"]
    assert (
        annotations["prometheus.io/scrape"] == "true"
        and annotations["prometheus.io/port"] == "8000"
    )
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    for name in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[name]["timeoutSeconds"] >= 1, name
    live = container["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] == 30  # not stretched by the grace
    startup = container["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert dep["spec"]["progressDeadlineSeconds"] > budget  # a slow load is not "stuck"
    assert container["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
    assert pod["terminationGracePeriodSeconds"] == 90
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert pod["nodeSelector"] == {"phasefleet.dev/accelerator": "nvidia-gpu"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["affinity"] == {"nodeAffinity": {"x": 1}}
    args = container["args"]
    assert args[:1] == ["worker"] and container["command"] == ["phasefleet"]
    assert args[args.index("--model") + 1] == "/models/tiny"
    assert args[args.index("--role") + 1] == "prefill"
    assert args[args.index("--port") + 1] == "8000"
    assert args[args.index("--max-num-batched-tokens") + 1] == "4096"
    assert int(args[args.index("--drain-timeout") + 1]) < 90


def test_security_context_is_locked_down():
    for child in desired_children(make_owner(), make_spec()):
        if child["kind"] != "Deployment":
            continue
        pod = _pod(child)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert "runAsUser" not in pod["securityContext"]  # the image's own user
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        (container,) = pod["containers"]
        sc = container["securityContext"]
        assert sc == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert "/tmp" in mounts


def test_pvc_source_mounts_the_claim_read_only():
    spec = make_spec(model={"pvc": {"claimName": "weights", "path": "/qwen"}})
    dep = worker_deployment(make_owner(), spec, Role.DECODE, replicas=1)
    pod = _pod(dep)
    (vol,) = [v for v in pod["volumes"] if v["name"] == "model"]
    assert vol["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    args = pod["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "/models/qwen"


def test_hf_token_comes_from_the_secret_by_reference_only():
    spec = make_spec(model={"hf": {"repoId": "org/m", "tokenSecret": {"name": "hf", "key": "tok"}}})
    dep = worker_deployment(make_owner(), spec, Role.DECODE, replicas=1)
    env = {e["name"]: e for e in _pod(dep)["containers"][0]["env"]}
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf", "key": "tok"}},
    }
    args = _pod(dep)["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "org/m"


def test_engine_knobs_reach_the_worker():
    spec = make_spec(
        model={"image": {"path": "/m"}, "dtype": "bfloat16", "maxModelLen": 4096},
        runtime={"blockSize": 32, "enablePrefixCaching": False, "extraArgs": ["--device", "cpu"]},
    )
    args = worker_deployment(make_owner(), spec, Role.DECODE, 1)["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    assert args[args.index("--dtype") + 1] == "bfloat16"
    assert args[args.index("--max-model-len") + 1] == "4096"
    assert args[args.index("--block-size") + 1] == "32"
    assert "--no-prefix-caching" in args
    assert args[-2:] == ["--device", "cpu"]


def test_router_points_at_the_pools():
    children = _by_key(desired_children(make_owner(), make_spec(router={"policy": "round-robin"})))
    args = _pod(children[("Deployment", "llm-router")])["containers"][0]["args"]
    assert args[0] == "router"
    assert args[args.index("--prefill-service") + 1] == "llm-prefill.team-a.svc:8000"
    assert args[args.index("--decode-service") + 1] == "llm-decode.team-a.svc:8000"
    assert args[args.index("--policy") + 1] == "round-robin"
    assert args[args.index("--hold-seconds") + 1] == "120"  # the spec's defaults
    assert args[args.index("--max-held-requests") + 1] == "256"


def test_spec_hash_changes_with_the_template_inputs_but_not_replicas():
    def digest(**overrides: Any) -> str:
        dep = worker_deployment(make_owner(), make_spec(**overrides), Role.DECODE, 1)
        return dep["spec"]["template"]["metadata"]["annotations"][SPEC_HASH_ANNOTATION]

    base = digest()
    assert digest(decode={"replicas": 5, "maxReplicas": 9}) == base
    assert digest(decode={"replicas": 2, "maxNumSeqs": 8}) != base
    assert digest(runtime={"image": "other:1"}) != base
    assert digest(decode={"replicas": 2, "tensorParallelSize": 1}) == base
    assert digest(decode={"replicas": 2, "tensorParallelSize": 2}) != base


def _engine_and_shm(spec: Any, role: Role) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = _pod(worker_deployment(make_owner(), spec, role, replicas=1))
    (container,) = pod["containers"]
    (shm,) = [v for v in pod["volumes"] if v["name"] == "shm"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    return container, shm["emptyDir"]


def test_a_tensor_parallel_gpu_pool_runs_its_degree_on_as_many_gpus_with_shm_for_nccl():
    from phasefleet.cli import build_parser

    gpus = {"limits": {"nvidia.com/gpu": 4, "memory": "64Gi"}}
    spec = make_spec(prefill={"tensorParallelSize": 4, "resources": gpus})
    engine, shm = _engine_and_shm(spec, Role.PREFILL)
    assert build_parser().parse_args(engine["args"]).tensor_parallel_size == 4
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert shm == {"medium": "Memory", "sizeLimit": "4Gi"}  # 1 GiB a rank
    decode, decode_shm = _engine_and_shm(spec, Role.DECODE)  # the other pool: one rank
    assert "--tensor-parallel-size" not in decode["args"]
    assert decode_shm == {"medium": "Memory"}


def test_a_tensor_parallel_cpu_pool_keeps_shm_unbounded_for_its_ranks_kv():
    from phasefleet.cli import build_parser

    spec = make_spec(mode="aggregated", prefill=None, decode=None, worker={"tensorParallelSize": 2})
    engine, shm = _engine_and_shm(spec, Role.WORKER)
    assert build_parser().parse_args(engine["args"]).tensor_parallel_size == 2
    assert "nvidia.com/gpu" not in engine.get("resources", {}).get("limits", {})
    assert shm == {"medium": "Memory"}  # ranks 1..N-1 share their KV pools through it


def test_pool_replicas_follow_spec_without_autoscaling_and_live_within_bounds_with_it():
    fixed = make_spec(decode={"replicas": 2, "minReplicas": 1, "maxReplicas": 4})
    assert fixed.decode is not None
    assert pool_replicas(fixed, fixed.decode, live=3) == 2
    scaled = make_spec(
        decode={"replicas": 2, "minReplicas": 1, "maxReplicas": 4}, autoscaling={"enabled": True}
    )
    assert scaled.decode is not None
    assert pool_replicas(scaled, scaled.decode, live=None) == 2
    assert pool_replicas(scaled, scaled.decode, live=3) == 3
    assert pool_replicas(scaled, scaled.decode, live=9) == 4
    assert pool_replicas(scaled, scaled.decode, live=0) == 1
    # Once the autoscaler's field manager owns the field, the operator leaves it out.
    assert pool_replicas(scaled, scaled.decode, live=3, autoscaled=True) is None
    assert pool_replicas(fixed, fixed.decode, live=3, autoscaled=True) == 2


def test_the_crds_parser_names_are_the_workers() -> None:
    from typing import get_args

    from phasefleet.api import contract
    from phasefleet.api.spec import RuntimeSpec

    fields = RuntimeSpec.model_fields
    for field, names in (
        ("tool_call_parser", contract.TOOL_CALL_PARSERS),
        ("reasoning_parser", contract.REASONING_PARSERS),
        ("scheduling_policy", contract.SCHEDULING_POLICIES),
        ("kv_cache_dtype", contract.KV_CACHE_DTYPES),
    ):
        annotation = fields[field].annotation
        plain = field in ("scheduling_policy", "kv_cache_dtype")  # not Optional
        literal = annotation if plain else get_args(annotation)[0]
        assert get_args(literal) == names, field


def test_worker_args_parse_with_the_worker_cli():
    """The operator's container args are accepted by `phasefleet worker` itself."""
    from phasefleet.cli import build_parser

    spec = make_spec(
        model={"image": {"path": "/m"}, "dtype": "bfloat16", "maxModelLen": 2048},
        runtime={
            "enablePrefixCaching": False,
            "blockSize": 32,
            "toolCallParser": "hermes",
            "reasoningParser": "qwen3",
            "schedulingPolicy": "priority",
            "numSpeculativeTokens": 4,
            "kvCacheDtype": "fp8",
        },
    )
    for role, engine_role in ((Role.PREFILL, "prefill"), (Role.DECODE, "decode")):
        dep = worker_deployment(make_owner(), spec, role, replicas=1)
        args = build_parser().parse_args(_pod(dep)["containers"][0]["args"])
        assert args.role == engine_role and args.port == 8000 and args.block_size == 32
        assert args.dtype == "bfloat16" and args.max_model_len == 2048 and args.no_prefix_caching
        assert args.tool_call_parser == "hermes" and args.reasoning_parser == "qwen3"
        assert args.scheduling_policy == "priority" and args.num_speculative_tokens == 4
        assert args.kv_cache_dtype == "fp8"
    aggregated = make_spec(mode="aggregated", prefill=None, decode=None, worker={})
    dep = worker_deployment(make_owner(), aggregated, Role.WORKER, replicas=1)
    container_args = _pod(dep)["containers"][0]["args"]
    assert "--kv-cache-dtype" not in container_args  # auto: the worker's own default
    parsed = build_parser().parse_args(container_args)
    assert parsed.role == "both" and parsed.kv_cache_dtype == "auto"


def test_the_host_kv_tier_reaches_every_pool_and_its_memory_bounds():
    """hostKvCacheSize becomes each worker's --host-kv-cache-gib and is added to the memory the
    pool requests and limits; a pool that requests no memory requests the tier alone."""
    from phasefleet.cli import build_parser

    bounded = {"resources": {"requests": {"memory": "8Gi"}, "limits": {"memory": "12Gi"}}}
    spec = make_spec(runtime={"hostKvCacheSize": "1536Mi"}, prefill=bounded)
    for role in (Role.PREFILL, Role.DECODE):
        container = _pod(worker_deployment(make_owner(), spec, role, replicas=1))["containers"][0]
        assert build_parser().parse_args(container["args"]).host_kv_cache_gib == 1.5
        if role is Role.PREFILL:
            assert container["resources"]["requests"]["memory"] == str((8 << 30) + (3 << 29))
            assert container["resources"]["limits"]["memory"] == str((12 << 30) + (3 << 29))
        else:
            assert container["resources"]["requests"]["memory"] == str(3 << 29)
            assert "memory" not in container["resources"].get("limits", {})
    off = _pod(worker_deployment(make_owner(), make_spec(), Role.DECODE, replicas=1))
    args = build_parser().parse_args(off["containers"][0]["args"])
    assert WorkerFlag.HOST_KV_CACHE_GIB not in off["containers"][0]["args"]
    assert args.host_kv_cache_gib == 0


def test_the_decode_pool_gets_the_phase_boundary_and_the_router_the_tpot_target():
    """The decode worker decides the phase boundary (the adaptive rule when the spec turns it
    on); the TPOT target that bounds its local prefill comes with each request from the router,
    which gets it only where a decode pool applies it. No worker carries it as a flag."""
    from phasefleet.cli import build_parser

    def parsed(spec, role):
        dep = worker_deployment(make_owner(), spec, role, replicas=1)
        return build_parser().parse_args(_pod(dep)["containers"][0]["args"])

    def router_tpot(spec):
        args = _pod(router_deployment(make_owner(), spec))["containers"][0]["args"]
        return build_parser().parse_args(args).tpot_target_ms

    assert not parsed(make_spec(), Role.DECODE).adaptive_phase_boundary
    adaptive = {"adaptivePhaseBoundary": True}
    spec = make_spec(slo={"tpotMs": 40}, runtime=adaptive)
    decode, prefill = parsed(spec, Role.DECODE), parsed(spec, Role.PREFILL)
    assert decode.adaptive_phase_boundary and decode.tpot_target_ms is None
    assert not prefill.adaptive_phase_boundary and prefill.tpot_target_ms is None
    assert router_tpot(spec) == 40
    assert router_tpot(make_spec(slo={"tpotMs": 40})) is None  # the fixed threshold: unused
    assert router_tpot(make_spec(runtime=adaptive)) is None
    aggregated = make_spec(
        mode="aggregated",
        prefill=None,
        decode=None,
        worker={},
        slo={"tpotMs": 40},
        runtime=adaptive,
    )
    assert router_tpot(aggregated) is None  # no decode pool, no boundary


def test_the_router_sends_the_ttft_target_for_late_prompts_last():
    """With slo.ttftMs the router is told the target (late prompts last, the default) and sends
    it with each request; with runtime.latePromptsLast false, or without a target, none is
    sent and the workers serve first come, first served. No worker carries it as a flag."""
    from phasefleet.cli import build_parser

    def late_after(spec):
        args = _pod(router_deployment(make_owner(), spec))["containers"][0]["args"]
        return build_parser().parse_args(args).late_after_ms

    def worker_flags(spec, role):
        dep = worker_deployment(make_owner(), spec, role, replicas=1)
        return build_parser().parse_args(_pod(dep)["containers"][0]["args"]).late_after_ms

    on = {"latePromptsLast": True}
    assert late_after(make_spec(slo={"ttftMs": 800}, runtime=on)) == 800
    aggregated = make_spec(
        mode="aggregated", prefill=None, decode=None, worker={}, slo={"ttftMs": 800}, runtime=on
    )
    assert late_after(aggregated) == 800
    assert late_after(make_spec(runtime=on)) is None
    assert late_after(make_spec(slo={"ttftMs": 800})) == 800  # on by default
    assert late_after(make_spec(slo={"ttftMs": 800}, runtime={"latePromptsLast": False})) is None
    # a target of 300 s or more is past the late prompts' own limit: first come, first served
    assert late_after(make_spec(slo={"ttftMs": 300_000}, runtime=on)) is None
    for role in (Role.PREFILL, Role.DECODE):
        assert worker_flags(make_spec(slo={"ttftMs": 800}), role) is None


def test_an_slo_edit_rolls_the_router_and_no_pool():
    """slo.ttftMs and slo.tpotMs reach the workers through the router's requests, so changing
    either rolls the router and no pool; the quantile and the autoscaling fields are the
    operator's alone and roll nothing."""

    def template(spec, role):
        return worker_deployment(make_owner(), spec, role, replicas=1)["spec"]["template"]

    def router_template(spec):
        return router_deployment(make_owner(), spec)["spec"]["template"]

    slo, adaptive = {"ttftMs": 800, "tpotMs": 50}, {"adaptivePhaseBoundary": True}
    before = make_spec(slo=slo, runtime=adaptive)
    targets = [
        make_spec(slo={**slo, "ttftMs": 900}, runtime=adaptive),
        make_spec(slo={**slo, "tpotMs": 60}, runtime=adaptive),
    ]
    operators = [
        make_spec(slo={**slo, "percentile": 0.99}, runtime=adaptive),
        make_spec(slo=slo, runtime=adaptive, autoscaling={"enabled": True, "maxStep": 3}),
    ]
    for role in (Role.PREFILL, Role.DECODE):
        assert all(template(after, role) == template(before, role) for after in targets + operators)
    assert all(router_template(after) != router_template(before) for after in targets)
    assert all(router_template(after) == router_template(before) for after in operators)


def test_engine_image_user_satisfies_run_as_non_root():
    """Pods set runAsNonRoot and no uid, so the image's USER must be numeric and not root."""
    from tests.dockerfile import instructions

    steps = instructions(Path(__file__).resolve().parents[2] / "runtime_image" / "Dockerfile")
    user = [rest for word, rest in steps if word == "USER"][-1]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, user


def test_disruption_budgets_let_unhealthy_pods_be_evicted():
    for child in desired_children(make_owner(), make_spec()):
        if child["kind"] == "PodDisruptionBudget":
            assert child["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
            assert child["spec"]["maxUnavailable"] == 1


def test_gpu_pools_roll_without_a_spare_gpu_by_default():
    gpu = {"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}}

    def strategy(**pool: Any) -> dict[str, Any]:
        spec = make_spec(decode={**gpu, **pool}, prefill={"replicas": 1})
        dep = worker_deployment(make_owner(), spec, Role.DECODE, 2)
        return dep["spec"]["strategy"]["rollingUpdate"]

    assert strategy() == {"maxSurge": 0, "maxUnavailable": 1}
    assert strategy(maxSurge=1) == {"maxSurge": 1, "maxUnavailable": 0}
    assert strategy(maxSurge=1, maxUnavailable=1) == {"maxSurge": 1, "maxUnavailable": 1}
    assert strategy(maxUnavailable=0) == {"maxSurge": 1, "maxUnavailable": 0}
    cpu = worker_deployment(make_owner(), make_spec(), Role.PREFILL, 1)
    assert cpu["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_rollout_settings_do_not_roll_the_pods():
    def digest(**pool: Any) -> str:
        dep = worker_deployment(make_owner(), make_spec(decode=pool), Role.DECODE, 1)
        return dep["spec"]["template"]["metadata"]["annotations"][SPEC_HASH_ANNOTATION]

    assert digest(replicas=1) == digest(replicas=1, maxSurge=2, maxUnavailable=1)


def test_runtime_env_cannot_shadow_the_operators_variables():
    hf = {"repoId": "o/m", "revision": "v1", "tokenSecret": {"name": "s"}}
    names: set[str] = set()
    for model in ({"hf": hf}, {"hf": hf, "cache": {"claimName": "models"}}):
        pod = worker_deployment(make_owner(), make_spec(model=model), Role.DECODE, 1)
        for container in [*_pod(pod).get("initContainers", []), *_pod(pod)["containers"]]:
            names |= {e["name"] for e in container["env"]}
    # every one the CRD forbids to users; a user's own plans file replaces the operator's
    # instead (no second entry: tests/operator/test_model_cache.py)
    assert names - {CPU_LINEAR_CACHE_ENV} == set(OPERATOR_ENV)


def test_containers_leave_their_fatal_error_where_kubernetes_reads_it():
    for child in desired_children(make_owner(), make_spec()):
        if child["kind"] != "Deployment":
            continue
        (container,) = _pod(child)["containers"]
        assert container["terminationMessagePath"] == "/dev/termination-log"
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
