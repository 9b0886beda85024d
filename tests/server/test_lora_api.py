"""LoRA adapters through the OpenAI API of real worker processes: a request names an adapter as
its `model`, /v1/models lists them with their base, the answers are PEFT's on transformers, and
the KV hand-off carries the adapter (a prefill worker without it leaves the prompt to the decode
worker)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from phasefleet.api.contract import INTERNAL_TOKEN_ENV, INTERNAL_TOKEN_HEADER
from phasefleet.engine.tiny_lora import make_tiny_lora
from tests.engine.factories import peft_greedy
from tests.server.hub_server import FakeHub, FakeRepo, read_folder
from tests.server.test_handoff import TOKEN, handoff_client
from tests.server.worker_proc import Worker, run_worker

PROMPT = [17, 250, 31, 402, 88, 9, 140, 77, 301, 12, 65, 199, 23, 48, 310, 5, 91, 222, 33]
N = 8


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "sql": make_tiny_lora(root / "sql", tiny_model, rank=4, seed=1),
        "poet": make_tiny_lora(root / "poet", tiny_model, rank=8, seed=2, targets=("q_proj",)),
    }


@pytest.fixture(scope="module")
def workers(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[tuple[Worker, Worker]]:
    """(prefill worker with `sql` only, decode worker with both), sharing the internal token."""
    mp = pytest.MonkeyPatch()
    mp.setenv(INTERNAL_TOKEN_ENV, TOKEN)
    both = [f"{name}={path}" for name, path in adapters.items()]
    args = ("--num-kv-blocks", "64", "--block-size", "4")
    try:
        with (
            run_worker(
                tiny_model, "--role", "prefill", "--lora-modules", f"sql={adapters['sql']}",
                "--max-loras", "2", *args,
            ) as prefill,
            run_worker(
                tiny_model, "--role", "decode", "--remote-prefill-min-tokens", "0",
                "--lora-modules", *both, *args,
            ) as decode,
        ):  # fmt: skip
            yield prefill, decode
    finally:
        mp.undo()


def answer_ids(client: openai.OpenAI, model: str, stream: bool = False) -> list[int]:
    """Greedy output token ids for PROMPT (the logprobs' tokens, as token ids)."""
    kw = dict(model=model, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=0)
    extra = {"return_token_ids": True}
    if not stream:
        out = client.completions.create(**kw, extra_body=extra)  # type: ignore[call-overload]
        return list(out.choices[0].model_extra["token_ids"])
    ids: list[int] = []
    for chunk in client.completions.create(**kw, stream=True, extra_body=extra):  # type: ignore[call-overload]
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
    return ids


def test_models_lists_the_adapters_with_their_base(workers: tuple[Worker, Worker]) -> None:
    _, decode = workers
    cards = {m.id: m for m in decode.client().models.list()}
    assert list(cards) == ["tiny", "sql", "poet"]
    assert (cards["sql"].model_extra or {})["parent"] == "tiny"
    assert (cards["tiny"].model_extra or {})["parent"] is None


@pytest.mark.parametrize("stream", [False, True])
def test_each_adapter_answers_as_peft_does(
    workers: tuple[Worker, Worker], tiny_model: Path, adapters: dict[str, Path], stream: bool
) -> None:
    _, decode = workers
    client = decode.client()
    for model, adapter in [("tiny", None), ("sql", adapters["sql"]), ("poet", adapters["poet"])]:
        assert answer_ids(client, model, stream) == peft_greedy(tiny_model, adapter, PROMPT, N)


def test_the_hand_off_carries_the_adapter(
    workers: tuple[Worker, Worker], tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """`sql` is prefilled on the prefill worker, which has it; `poet` is refused there (409,
    lora_not_loaded) and prefilled on the decode worker. Both answers are PEFT's."""
    prefill, decode = workers
    client = handoff_client(decode, prefill.base_url)
    remote_before = decode.counter("phasefleet_prefills_total", where="remote")
    local_before = decode.counter("phasefleet_prefills_total", where="local")
    assert answer_ids(client, "sql") == peft_greedy(tiny_model, adapters["sql"], PROMPT, N)
    assert decode.counter("phasefleet_prefills_total", where="remote") == remote_before + 1
    assert answer_ids(client, "poet") == peft_greedy(tiny_model, adapters["poet"], PROMPT, N)
    assert decode.counter("phasefleet_prefills_total", where="local") == local_before + 1
    body = {"wire_version": 4, "request_id": "x", "prompt_token_ids": PROMPT, "max_tokens": 2,
            "lora": "poet"}  # fmt: skip
    refused = httpx.post(
        f"{prefill.base_url}/internal/prefill", json=body, headers={INTERNAL_TOKEN_HEADER: TOKEN}
    )
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "lora_not_loaded"


def test_an_unknown_model_is_a_404_naming_what_is_served(workers: tuple[Worker, Worker]) -> None:
    _, decode = workers
    with pytest.raises(openai.NotFoundError) as caught:
        decode.client().completions.create(model="nope", prompt="hi", max_tokens=2)
    assert caught.value.code == "model_not_found"
    assert "'tiny', 'sql', 'poet'" in caught.value.message


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--lora-modules", "x={tmp}"), "has no adapter_config.json"),
        (("--enable-runtime-lora",), "--enable-runtime-lora needs adapter slots"),
    ],
)
def test_a_bad_lora_flag_exits_with_a_message(
    tiny_model: Path, tmp_path: Path, flags: tuple[str, ...], message: str
) -> None:
    args = [flag.format(tmp=tmp_path) for flag in flags]
    with run_worker(tiny_model, *args, wait_healthy=False) as worker:
        assert worker.proc.wait(timeout=120) == 2
        assert message in worker.log()


def test_an_adapter_the_engine_refuses_is_the_termination_message(
    tiny_model: Path, adapters: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank above --max-lora-rank is found when the engine loads the adapter: exit 1, and
    the termination message (what Kubernetes shows as the pod's reason) says to fix the flag."""
    log = tmp_path / "termination-log"
    monkeypatch.setenv("PHASEFLEET_TERMINATION_LOG", str(log))
    flags = ("--lora-modules", f"poet={adapters['poet']}", "--max-lora-rank", "4")  # rank 8
    with run_worker(tiny_model, *flags, wait_healthy=False) as worker:
        assert worker.proc.wait(timeout=120) == 1
    message = log.read_text()
    assert message.startswith("model ") and "cannot serve its LoRA adapters" in message
    assert "'poet'" in message and message.rstrip().endswith("fix --lora-modules")


@pytest.fixture
def hub_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A clean Hugging Face environment ($HF_HOME)."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "HF_REVISION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    return tmp_path / "hf"


def test_an_adapter_from_the_hub_is_fetched_and_served(
    tiny_model: Path, adapters: dict[str, Path], hub_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--lora-modules sql=org/sql-lora@v1`: only the adapter's two files are fetched, into
    the Hub cache, and the answer is PEFT's with the same adapter."""
    files = read_folder(adapters["sql"]) | {"README.md": b"# sql\n", "training_args.bin": b"\0"}
    hub = FakeHub({"org/sql-lora": FakeRepo({"main": {"README.md": b"old"}, "v1": files})})
    with hub as hub_server:
        monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
        with run_worker(tiny_model, "--lora-modules", "sql=org/sql-lora@v1") as worker:
            answer = answer_ids(worker.client(), "sql")
        assert hub_server.fetched_files() == {"adapter_config.json", "adapter_model.safetensors"}
    assert answer == peft_greedy(tiny_model, adapters["sql"], PROMPT, N)
    assert (hub_home / "hub" / "models--org--sql-lora").is_dir()


def test_a_repo_that_is_no_adapter_is_refused_in_one_line(
    hub_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from phasefleet.server.adapters import resolve_adapters
    from phasefleet.server.hub import ModelFetchError

    with FakeHub({"org/model": FakeRepo({"main": {"config.json": b"{}"}})}) as hub_server:
        monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
        with pytest.raises(ModelFetchError, match="is not a PEFT LoRA adapter repository"):
            resolve_adapters({"x": "org/model"})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("sql", "entries are NAME=PATH or NAME=org/repo"),
        ("=x/y", "is not a usable name"),
        ("tiny=x/y", "used twice"),
        ("a/b=x/y", "is not a usable name"),
        ("sql=./nowhere", "has no adapter_config.json"),
    ],
)
def test_bad_lora_modules_entries_name_the_fix(value: str, message: str) -> None:
    from phasefleet.server.adapters import parse_lora_modules

    with pytest.raises(ValueError, match=message):
        parse_lora_modules([value], "tiny")
    assert parse_lora_modules(["a=org/repo@v2", "b=org/other"], "tiny") == {
        "a": "org/repo@v2",
        "b": "org/other",
    }


@pytest.fixture(scope="module")
def runtime_worker(tiny_model: Path) -> Iterator[Worker]:
    with run_worker(
        tiny_model, "--max-loras", "2", "--enable-runtime-lora", "--block-size", "4"
    ) as worker:
        yield worker


def post(worker: Worker, path: str, body: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{worker.base_url}/v1/{path}", json=body, timeout=60)


def test_adapters_load_and_unload_at_runtime(
    runtime_worker: Worker, tiny_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: an adapter loaded while the
    worker runs is listed and answers as PEFT does; a name loaded twice, a folder that is not
    an adapter and a third adapter for two slots are 400s that change nothing; an adapter in
    use is not unloaded (409); an unloaded one is a 404 for requests; a name loaded again with
    other weights answers with those (its cached prefix is not reused)."""
    client = runtime_worker.client()
    assert [m.id for m in client.models.list()] == ["tiny"]
    sql, poet = str(adapters["sql"]), str(adapters["poet"])
    loaded = post(runtime_worker, "load_lora_adapter", {"lora_name": "sql", "lora_path": sql})
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    assert [m.id for m in client.models.list()] == ["tiny", "sql"]
    assert answer_ids(client, "sql") == peft_greedy(tiny_model, adapters["sql"], PROMPT, N)

    for body, message in [
        ({"lora_name": "sql", "lora_path": poet}, "already loaded"),
        ({"lora_name": "x", "lora_path": str(tmp_path)}, "has no adapter_config.json"),
        ({"lora_name": "tiny", "lora_path": poet}, "used twice"),
    ]:
        refused = post(runtime_worker, "load_lora_adapter", body)
        assert refused.status_code == 400 and message in refused.json()["error"]["message"]
    assert post(runtime_worker, "load_lora_adapter", {"lora_name": "poet", "lora_path": poet})
    full = post(runtime_worker, "load_lora_adapter", {"lora_name": "x", "lora_path": poet})
    assert full.status_code == 400 and "all 2 slots are taken" in full.text

    long = client.completions.create(
        model="poet", prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(long))  # running now
    info = [k for k in runtime_worker.metrics() if k.startswith("phasefleet_lora_requests_info")]
    assert len(info) == 1 and 'running_lora_adapters="poet"' in info[0], info
    assert 'waiting_lora_adapters=""' in info[0] and 'max_lora="2"' in info[0]
    busy = post(runtime_worker, "unload_lora_adapter", {"lora_name": "poet"})
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "lora_in_use"
    assert sum(1 for _ in long) > 0
    assert post(runtime_worker, "unload_lora_adapter", {"lora_name": "poet"}).status_code == 200
    assert [m.id for m in client.models.list()] == ["tiny", "sql"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="poet", prompt="hi", max_tokens=2)
    gone = post(runtime_worker, "unload_lora_adapter", {"lora_name": "poet"})
    assert gone.status_code == 404

    # `sql` again, now with poet's weights: the same prompt's blocks cached under the old sql
    # must not be hits
    assert post(runtime_worker, "unload_lora_adapter", {"lora_name": "sql"}).status_code == 200
    assert post(runtime_worker, "load_lora_adapter", {"lora_name": "sql", "lora_path": poet})
    assert answer_ids(client, "sql") == peft_greedy(tiny_model, adapters["poet"], PROMPT, N)


def test_the_runtime_endpoints_need_the_flag(workers: tuple[Worker, Worker]) -> None:
    _, decode = workers
    body = {"lora_name": "x", "lora_path": "/tmp"}
    assert post(decode, "load_lora_adapter", body).status_code == 404
