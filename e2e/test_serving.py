"""Every InferenceService really serves: the operator's pods run as local processes (the pod
runner, e2e/harness/podrunner.py), each at its own pod IP, Ready only when its readiness probe
passes. The official `openai` client talks to the router's pod, which finds the workers through
EndpointSlices with its ServiceAccount's token (filled in by the runner from the TokenRequest
API), and greedy output equals a worker started directly on the same model."""

from __future__ import annotations

import ipaddress
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from e2e.harness.controlplane import ControlPlane
from e2e.harness.phasefleet_operator import (
    Operator,
    get,
    is_ready,
)
from e2e.harness.podnet import POD_RANGE
from e2e.harness.serving import (
    AGGREGATED,
    API_KEYS,
    DISAGGREGATED,
    client,
    pods,
    ready_ips,
    wait_router_sees,
)
from e2e.harness.wait import wait_for
from phasefleet.api.contract import ROUTER_PORT, WORKER_PORT

PROMPTS = ["Hello, my name is", "The capital of France", "1 2 3 4 5"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def reference(cluster: ControlPlane, image_model: str) -> Iterator[Any]:
    """A worker started directly (no Kubernetes) on the same files and settings."""
    from tests.server.worker_proc import run_worker

    local = cluster.image_root / image_model.lstrip("/")
    with run_worker(local, "--dtype", "float32", "--max-model-len", "512") as worker:
        yield worker


def complete(api: openai.OpenAI, prompt: str, stream: bool, **extra: Any) -> str:
    if not stream:
        answer = api.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, **extra
        )
        return answer.choices[0].text
    chunks = api.completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True, **extra
    )
    return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)


@pytest.fixture
def serve(
    cluster: ControlPlane, operator: Operator, run_namespace: str, image_model: str
) -> Callable[[Path], str]:
    """Applies an example in a run namespace and waits until it is Ready; returns its name."""

    def apply(example: Path) -> str:
        cluster.kubectl("apply", "-n", run_namespace, "-f", str(example))
        docs = yaml.safe_load_all(example.read_text())
        (name,) = [d["metadata"]["name"] for d in docs if d and d["kind"] == "InferenceService"]
        try:
            wait_for(lambda: is_ready(cluster, run_namespace, name), 360, f"{name} Ready")
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\noperator log tail:\n{operator.log()[-3000:]}") from None
        return name

    return apply


def test_pods_are_ready_only_once_their_probe_passes(
    cluster: ControlPlane, serve: Callable[[Path], str], run_namespace: str
) -> None:
    serve(AGGREGATED)
    for role in ("worker", "router"):
        for pod in pods(cluster, run_namespace, role):
            ip = pod["status"]["podIP"]
            assert ipaddress.ip_address(ip) in POD_RANGE, ip
            (status,) = pod["status"]["containerStatuses"]
            assert status["ready"] and status["started"] and "running" in status["state"]
            assert status["restartCount"] == 0
            port = WORKER_PORT if role == "worker" else ROUTER_PORT
            assert httpx.get(f"http://{ip}:{port}/health", timeout=5).status_code == 200
            log = cluster.pod_log(
                run_namespace, pod["metadata"]["name"], pod["spec"]["containers"][0]["name"]
            )
            # The runner probed the process itself; the pod turned Ready after that.
            assert '"GET /health HTTP/1.1" 200' in log
    ips = [
        p["status"]["podIP"] for r in ("worker", "router") for p in pods(cluster, run_namespace, r)
    ]
    assert len(set(ips)) == 3


def test_aggregated_example_answers_through_its_router(
    cluster: ControlPlane, serve: Callable[[Path], str], run_namespace: str, reference: Any
) -> None:
    name = serve(AGGREGATED)
    (router,) = pods(cluster, run_namespace, "router")
    assert router["spec"]["serviceAccountName"] == f"{name}-router"
    assert any(v["name"].startswith("kube-api-access-") for v in router["spec"]["volumes"])
    ip = router["status"]["podIP"]
    wait_router_sees(ip, {"worker": 2})
    through_router = client(ip, ROUTER_PORT)
    direct = reference.client()
    for prompt in PROMPTS:
        want = complete(direct, prompt, stream=False)
        assert complete(through_router, prompt, stream=False) == want
        assert complete(through_router, prompt, stream=True) == want
    chat = through_router.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    want_chat = direct.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert chat.choices[0].message.content == want_chat.choices[0].message.content


def test_deleting_a_worker_pod_during_streams(
    cluster: ControlPlane, serve: Callable[[Path], str], run_namespace: str, reference: Any
) -> None:
    name = serve(AGGREGATED)
    (ip,) = ready_ips(cluster, run_namespace, "router")
    wait_router_sees(ip, {"worker": 2})
    long: dict[str, Any] = {"max_tokens": 400, "extra_body": {"ignore_eos": True}}
    want = reference.client().completions.create(
        model="tiny", prompt=PROMPTS[0], temperature=0, **long
    )
    want_text = want.choices[0].text
    results: list[str | BaseException] = []

    def stream() -> None:
        try:
            chunks = client(ip, ROUTER_PORT).completions.create(
                model="tiny", prompt=PROMPTS[0], temperature=0, stream=True, **long
            )
            results.append("".join(c.choices[0].text for c in chunks if c.choices))
        except BaseException as exc:  # recorded, asserted below
            results.append(exc)

    threads = [threading.Thread(target=stream) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)  # every stream has its first tokens
    (victim, survivor) = pods(cluster, run_namespace, "worker")
    cluster.kubectl(
        "delete", "pod", victim["metadata"]["name"], "-n", run_namespace, "--wait=false"
    )
    for thread in threads:
        thread.join(timeout=180)
    assert [r if isinstance(r, BaseException) else r == want_text for r in results] == [True] * 4

    # The Deployment's new pod is started by the runner and joins the router's pool.
    def replaced() -> list[str] | None:
        ips = ready_ips(cluster, run_namespace, "worker")
        gone = get(cluster, "pod", victim["metadata"]["name"], "-n", run_namespace) is None
        return ips if gone and len(ips) == 2 and victim["status"]["podIP"] not in ips else None

    ips = wait_for(replaced, 180, "a new worker pod Ready and the old one gone")
    (new_ip,) = set(ips) - {survivor["status"]["podIP"]}
    wait_router_sees(ip, {"worker": 2})
    router = client(ip, ROUTER_PORT)
    before = httpx.get(f"http://{new_ip}:{WORKER_PORT}/metrics", timeout=5).text
    for prompt in PROMPTS * 2:
        assert complete(router, prompt, stream=False) == complete(
            reference.client(), prompt, stream=False
        )
    after = httpx.get(f"http://{new_ip}:{WORKER_PORT}/metrics", timeout=5).text
    tokens = "phasefleet_generation_tokens_total"
    assert sample(after, tokens) > sample(before, tokens), f"{name}: the new pod got no work"


def test_disaggregated_example_answers_through_its_router(
    cluster: ControlPlane, serve: Callable[[Path], str], run_namespace: str, reference: Any
) -> None:
    name = serve(DISAGGREGATED)
    (ip,) = ready_ips(cluster, run_namespace, "router")
    wait_router_sees(ip, {"prefill": 1, "decode": 1})
    through_router = client(ip, ROUTER_PORT)
    direct = reference.client()
    wants = {prompt: complete(direct, prompt, stream=False) for prompt in PROMPTS}
    for prompt, want in wants.items():  # short prompts: the decode worker prefills them
        assert complete(through_router, prompt, stream=False) == want
        assert complete(through_router, prompt, stream=True) == want

    # Every prompt prefilled remotely: the operator rolls both pools, the runner replaces pods.
    patch = '{"spec": {"runtime": {"remotePrefillMinTokens": 0}}}'
    cluster.kubectl(
        "patch", "inferenceservice", name, "-n", run_namespace, "--type=merge", "-p", patch
    )
    wait_for(lambda: rolled_out(cluster, run_namespace, name), 420, "both pools rolled")
    wait_router_sees(ip, {"prefill": 1, "decode": 1})
    for prompt, want in wants.items():
        assert complete(through_router, prompt, stream=False) == want
        assert complete(through_router, prompt, stream=True) == want
    (decode,) = ready_ips(cluster, run_namespace, "decode")
    metrics = httpx.get(f"http://{decode}:{WORKER_PORT}/metrics", timeout=5).text
    assert sample(metrics, "phasefleet_prefills_total", 'where="remote"') == 2 * len(PROMPTS)
    assert sample(metrics, "phasefleet_kv_transfer_bytes_total") > 0

    # An embedding goes to the prefill pod (no hand-off): the decode pod computes nothing.
    decode_prompts = sample(metrics, "phasefleet_prompt_tokens_total")
    got = through_router.embeddings.create(model="tiny", input=PROMPTS)
    want = direct.embeddings.create(model="tiny", input=PROMPTS)
    for mine, theirs in zip(got.data, want.data, strict=True):
        assert mine.embedding == pytest.approx(theirs.embedding, abs=1e-5)
    metrics = httpx.get(f"http://{decode}:{WORKER_PORT}/metrics", timeout=5).text
    assert sample(metrics, "phasefleet_prompt_tokens_total") == decode_prompts


def test_a_service_with_api_keys_answers_only_clients_holding_one(
    cluster: ControlPlane, serve: Callable[[Path], str], run_namespace: str, reference: Any
) -> None:
    """The keys reach the router and the worker from the user's Secret: with either key the
    answer is the reference's; without one, or with another, 401 from both; probes pass. An
    edit of the Secret reaches the running pods (the mounted file, re-read): the new key is
    taken and the dropped one refused, with no pod restarted."""
    serve(API_KEYS)
    (ip,) = ready_ips(cluster, run_namespace, "router")
    wait_router_sees(ip, {"worker": 1})  # /health needs no key
    want = complete(reference.client(), PROMPTS[0], stream=False)
    for key in ("replace-me", "and-me"):
        assert complete(client(ip, ROUTER_PORT, key), PROMPTS[0], stream=True) == want
    (worker,) = ready_ips(cluster, run_namespace, "worker")
    for address in ((ip, ROUTER_PORT), (worker, WORKER_PORT)):
        with pytest.raises(openai.AuthenticationError):
            complete(client(*address, api_key="guess"), PROMPTS[0], stream=False)
        assert httpx.get(f"http://{address[0]}:{address[1]}/metrics", timeout=5).status_code == 200
    assert complete(client(worker, WORKER_PORT, "and-me"), PROMPTS[0], stream=False) == want

    before = {
        p["metadata"]["uid"] for r in ("router", "worker") for p in pods(cluster, run_namespace, r)
    }
    rotated = '{"stringData": {"keys": "and-me,rotated"}}'  # replace-me dropped, rotated added
    cluster.kubectl("patch", "secret", "tiny-keys", "-n", run_namespace, "-p", rotated)

    def answers(address: tuple[str, int], key: str) -> bool:
        try:
            complete(client(*address, api_key=key), PROMPTS[0], stream=False)
        except openai.AuthenticationError:
            return False
        return True

    for address in ((ip, ROUTER_PORT), (worker, WORKER_PORT)):
        wait_for(lambda a=address: answers(a, "rotated"), timeout=60, what="the rotated key")  # type: ignore[misc]
        assert not answers(address, "replace-me") and answers(address, "and-me")
    after = {
        p["metadata"]["uid"] for r in ("router", "worker") for p in pods(cluster, run_namespace, r)
    }
    assert after == before  # no pod replaced
    restarts = [
        s["restartCount"]
        for r in ("router", "worker")
        for p in pods(cluster, run_namespace, r)
        for s in p["status"]["containerStatuses"]
    ]
    assert restarts == [0, 0]


def rolled_out(cluster: ControlPlane, namespace: str, name: str) -> bool:
    """The new generation observed, Ready, and one pod per pool left (old ones gone)."""
    isvc = get(cluster, "inferenceservice", name, "-n", namespace) or {}
    observed = (isvc.get("status") or {}).get("observedGeneration")
    return (
        observed == isvc["metadata"]["generation"]
        and is_ready(cluster, namespace, name)
        and all(len(pods(cluster, namespace, role)) == 1 for role in ("prefill", "decode"))
    )


def sample(metrics: str, name: str, label: str = "") -> float:
    """The sum of a metric's samples whose labels contain `label`."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name) and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total
