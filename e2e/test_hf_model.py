"""`spec.model.hf` serves: the operator's worker pod (run by the pod runner as a process) gets
the repo id as --model, HF_REVISION from `revision` and HF_TOKEN from `tokenSecret`, downloads
the repository into its cache emptyDir from a local Hub (tests/server/hub_server.py, via
HF_ENDPOINT in runtime.env) and answers through the router as a worker started directly on the
same files does. The repository is gated, so the download works only if the Secret's token
reached the worker. A LoRA adapter from the same Hub (`spec.lora`) is served beside it under
its own name, as a worker started directly with the adapter's folder serves it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from e2e.harness.controlplane import ControlPlane
from e2e.harness.phasefleet_operator import Operator, get, is_ready
from e2e.harness.wait import wait_for
from phasefleet.api.contract import ROUTER_PORT
from tests.server.hub_server import FakeHub, FakeRepo, read_folder

REPO = "org/tiny-gated"
ADAPTER_REPO = "org/tiny-lora"
TOKEN = "hf_e2e_granted"
PROMPTS = ["Hello, my name is", "The capital of France"]


@pytest.fixture
def adapter(cluster: ControlPlane, image_model: str, tmp_path: Path) -> Path:
    from phasefleet.engine.tiny_lora import make_tiny_lora

    return make_tiny_lora(tmp_path / "adapter", cluster.image_root / image_model.lstrip("/"))


@pytest.fixture
def local_hub(cluster: ControlPlane, image_model: str, adapter: Path) -> Iterator[FakeHub]:
    files = read_folder(cluster.image_root / image_model.lstrip("/"))
    files["README.md"] = b"# not for the engine\n"
    files["pytorch_model.bin"] = b"\0" * 1024
    repo = FakeRepo({"main": files, "v1": files}, gated=True, allowed_tokens={TOKEN})
    lora = FakeRepo({"main": read_folder(adapter)}, gated=True, allowed_tokens={TOKEN})
    with FakeHub({REPO: repo, ADAPTER_REPO: lora}, tokens={TOKEN}) as hub:
        yield hub


def manifest(hub_url: str) -> dict[str, Any]:
    return {
        "apiVersion": "serving.phasefleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "from-hub"},
        "spec": {
            "model": {
                "hf": {"repoId": REPO, "revision": "v1", "tokenSecret": {"name": "hf-token"}},
                "servedName": "tiny",
                "maxModelLen": 512,
                "dtype": "float32",
            },
            "mode": "aggregated",
            "worker": {"replicas": 1, "maxNumSeqs": 4},
            "router": {"replicas": 1},
            "runtime": {"env": [{"name": "HF_ENDPOINT", "value": hub_url}]},
            "lora": {"adapters": [{"name": "tiny-lora", "hf": {"repoId": ADAPTER_REPO}}]},
        },
    }


def test_a_gated_hub_model_is_downloaded_with_the_secret_token_and_served(
    cluster: ControlPlane,
    operator: Operator,
    run_namespace: str,
    image_model: str,
    local_hub: FakeHub,
    adapter: Path,
) -> None:
    from tests.server.worker_proc import run_worker

    cluster.kubectl(
        "create", "secret", "generic", "hf-token", f"--from-literal=token={TOKEN}",
        "-n", run_namespace,
    )  # fmt: skip
    cluster.kubectl(
        "apply", "-n", run_namespace, "-f", "-", input=json.dumps(manifest(local_hub.url))
    )
    try:
        wait_for(lambda: is_ready(cluster, run_namespace, "from-hub"), 360, "from-hub Ready")
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}\noperator log tail:\n{operator.log()[-3000:]}") from None

    found = get(cluster, "pods", "-n", run_namespace, "-l", "phasefleet.dev/role=router")
    router_ip = found["items"][0]["status"]["podIP"]
    through_router = openai.OpenAI(
        base_url=f"http://{router_ip}:{ROUTER_PORT}/v1", api_key="unused", max_retries=0
    )
    local = cluster.image_root / image_model.lstrip("/")
    flags = (
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--lora-modules",
        f"tiny-lora={adapter}",
    )
    with run_worker(local, *flags) as direct:
        answers = {}
        for model in ("tiny", "tiny-lora"):
            for prompt in PROMPTS:
                want = direct.client().completions.create(
                    model=model, prompt=prompt, max_tokens=12, temperature=0
                )
                got = through_router.completions.create(
                    model=model, prompt=prompt, max_tokens=12, temperature=0
                )
                assert got.choices[0].text == want.choices[0].text
                answers[model, prompt] = got.choices[0].text
    assert any(answers["tiny", p] != answers["tiny-lora", p] for p in PROMPTS)
    listed = {m.id: m.model_extra for m in through_router.models.list()}
    assert (listed["tiny-lora"] or {})["parent"] == "tiny"

    commit = local_hub.repos[REPO].commit("v1")
    assert commit is not None
    info_paths = {r.path for r in local_hub.requests if r.path.startswith("/api/models/")}
    assert info_paths == {
        f"/api/models/{REPO}/revision/v1",
        f"/api/models/{ADAPTER_REPO}",  # no revision: the Hub's default branch
    }
    assert {"README.md", "pytorch_model.bin", "phasefleet-tiny.json"}.isdisjoint(
        local_hub.fetched_files()
    )
    assert "model.safetensors" in local_hub.fetched_files()
    pods = get(cluster, "pods", "-n", run_namespace, "-l", "phasefleet.dev/role=worker")
    pod = pods["items"][0]
    log = cluster.pod_log(run_namespace, pod["metadata"]["name"], "engine")
    assert f"fetching model {REPO} (revision v1, commit {commit[:12]})" in log
    assert f"{REPO}: model.safetensors (" in log
    assert TOKEN not in log
