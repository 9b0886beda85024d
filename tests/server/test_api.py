"""The worker's OpenAI API over real localhost HTTP, with the official openai client.

One worker process (tiny random Llama) serves every test in this module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from phasefleet.engine.sampling_params import (
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
)
from tests.server.worker_proc import Worker, parse_metrics

PROMPT = "The prefill worker reads the whole prompt"


def extra(obj: Any, name: str) -> Any:
    """A vLLM-style extension field of an openai response object."""
    return (obj.model_extra or {})[name]


def test_health_and_models(worker: Worker, client: openai.OpenAI) -> None:
    health = httpx.get(f"{worker.base_url}/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert extra(models[0], "max_model_len") == 2048


def test_completion_text_prompt(client: openai.OpenAI, tokenizer: Any) -> None:
    res = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = res.choices[0]
    assert res.object == "text_completion"
    assert choice.finish_reason == "length"
    assert choice.text
    assert res.usage is not None
    assert res.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert res.usage.completion_tokens == 7
    assert res.usage.total_tokens == res.usage.prompt_tokens + 7


def test_token_id_prompt_matches_text_prompt(client: openai.OpenAI, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT)
    body = {"ignore_eos": True, "return_token_ids": True}
    by_text = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, extra_body=body
    )
    by_ids = client.completions.create(
        model="tiny", prompt=ids, max_tokens=6, temperature=0, extra_body=body
    )
    assert extra(by_ids.choices[0], "prompt_token_ids") == ids
    assert extra(by_text.choices[0], "prompt_token_ids") == ids
    assert extra(by_ids.choices[0], "token_ids") == extra(by_text.choices[0], "token_ids")
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert len(extra(by_ids.choices[0], "token_ids")) == 6


def test_greedy_matches_offline_engine(
    client: openai.OpenAI, tokenizer: Any, tiny_model: Path
) -> None:
    from phasefleet.engine.config import EngineConfig
    from phasefleet.engine.llm_engine import LLMEngine
    from phasefleet.engine.sampling_params import SamplingParams

    ids = tokenizer.encode(PROMPT)
    engine = LLMEngine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=32))
    [offline] = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0))
    res = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=12,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert extra(res.choices[0], "token_ids") == offline.output_token_ids
    assert res.choices[0].text == offline.text
    assert res.choices[0].finish_reason == offline.finish_reason


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[int]:
        res = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=10,
            temperature=1.5,
            seed=seed,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        return list(extra(res.choices[0], "token_ids"))

    first = sample(7)
    assert sample(7) == first
    others = [sample(seed) for seed in (8, 9, 10)]
    assert any(other != first for other in others)


def test_stop_string_ends_the_text(client: openai.OpenAI) -> None:
    full = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0]
    # A two-letter stop string that first occurs a few characters into the greedy text.
    at = next(
        i
        for i in range(3, len(full.text) - 1)
        if full.text[i : i + 2].isalpha() and full.text.find(full.text[i : i + 2]) == i
    )
    stop = full.text[at : at + 2]
    cut = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stop=[stop, "never-generated-zzz"],
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert cut.text == full.text[:at]
    assert cut.finish_reason == "stop"
    kept = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    ).choices[0]
    assert kept.text == full.text[: at + 2] and kept.finish_reason == "stop"


def test_skip_special_tokens_false_keeps_them_in_the_text(
    client: openai.OpenAI, tokenizer: Any
) -> None:
    """The end of the turn, a special token, shows in the text only when asked (ignore_eos and
    logit_bias make the model write it: <|im_end|> is not the tiny model's eos)."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def text(**extra_body: Any) -> str:
        return client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, temperature=0,
            logit_bias={str(end): 100}, extra_body={"ignore_eos": True, **extra_body},
        ).choices[0].text  # fmt: skip

    assert text() == ""
    assert text(skip_special_tokens=False) == "<|im_end|><|im_end|>"


def test_truncate_prompt_tokens_keeps_the_prompts_end(
    client: openai.OpenAI, tokenizer: Any
) -> None:
    ids = tokenizer.encode(PROMPT)
    assert len(ids) > 4

    def answer(prompt: Any, **extra_body: Any) -> Any:
        return client.completions.create(
            model="tiny", prompt=prompt, max_tokens=4, temperature=0, echo=True,
            extra_body={"return_token_ids": True, **extra_body},
        ).choices[0]  # fmt: skip

    cut = answer(PROMPT, truncate_prompt_tokens=4)
    assert extra(cut, "prompt_token_ids") == ids[-4:]
    assert cut.text == answer(ids[-4:]).text  # as if only the last four were sent, echo too
    assert extra(answer(PROMPT, truncate_prompt_tokens=-1), "prompt_token_ids") == ids
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        answer(PROMPT, truncate_prompt_tokens=0)


def test_chat_completion_uses_chat_template(client: openai.OpenAI, tokenizer: Any) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    plain = client.completions.create(
        model="tiny", prompt=rendered, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == plain.choices[0].text
    assert chat.choices[0].finish_reason == "length"
    assert extra(chat.choices[0], "prompt_token_ids") == list(rendered)
    assert len(extra(chat.choices[0], "token_ids")) == 8
    assert chat.usage is not None
    assert chat.usage.prompt_tokens == len(rendered)
    assert chat.usage.completion_tokens == 8


def test_continue_final_message_continues_the_assistants_words(
    client: openai.OpenAI, tokenizer: Any
) -> None:
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is"},
    ]
    rendered = tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True, tokenize=True
    )
    assert tokenizer.decode(rendered).endswith("The capital of France is")  # no end of turn
    chat = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=2,
        extra_body={
            "continue_final_message": True,
            "add_generation_prompt": False,
            "return_token_ids": True,
        },
    )
    assert extra(chat.choices[0], "prompt_token_ids") == list(rendered)


def test_chat_template_kwargs_reach_the_template(
    worker: Worker, client: openai.OpenAI, tokenizer: Any
) -> None:
    """vLLM's `chat_template_kwargs`: the tiny template's `enable_thinking` (Qwen3's switch)
    reaches it through a chat request and through /tokenize; a key that would set one of
    apply_chat_template's own parameters is a 400 naming the field."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    no_thought = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, enable_thinking=False
    )
    assert len(no_thought) > len(plain)  # the template does read it
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    chat = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=2,
        extra_body={**kwargs, "return_token_ids": True},
    )
    assert extra(chat.choices[0], "prompt_token_ids") == list(no_thought)
    tokens = httpx.post(f"{worker.base_url}/tokenize", json={"messages": messages, **kwargs})
    assert tokens.json()["tokens"] == list(no_thought)
    with pytest.raises(openai.BadRequestError, match="may not set tokenize") as info:
        client.chat.completions.create(
            model="tiny",
            messages=messages,  # type: ignore[arg-type]
            extra_body={"chat_template_kwargs": {"tokenize": False}},
        )
    assert info.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]


def test_streaming_completion_with_usage(client: openai.OpenAI) -> None:
    body = {"ignore_eos": True, "return_token_ids": True}
    whole = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=9, temperature=0, extra_body=body
    )
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=body,
        )
    )
    *token_chunks, usage_chunk = chunks
    assert all(c.usage is None for c in token_chunks)
    assert "".join(c.choices[0].text for c in token_chunks) == whole.choices[0].text
    streamed_ids = [t for c in token_chunks for t in extra(c.choices[0], "token_ids")]
    assert streamed_ids == extra(whole.choices[0], "token_ids")
    assert [c.choices[0].finish_reason for c in token_chunks][-1] == "length"
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert whole.usage is not None
    assert usage_chunk.usage.completion_tokens == 9
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_streaming_chat_with_usage(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Count from one to ten"}]
    whole = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8


def test_n_choices_and_prompt_batches(client: openai.OpenAI) -> None:
    res = client.completions.create(
        model="tiny",
        prompt=[PROMPT, "Blocks of sixteen tokens"],
        n=2,
        max_tokens=4,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in res.choices] == [0, 1, 2, 3]
    assert res.usage is not None
    assert res.usage.completion_tokens == 16
    single = client.completions.create(
        model="tiny",
        prompt="Blocks of sixteen tokens",
        max_tokens=4,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    # Choice i of a prompt samples with seed + i, whatever else is in the batch.
    assert res.choices[2].text == single.choices[0].text


TOO_LONG = "word " * 3000

BAD_COMPLETIONS: list[tuple[dict[str, Any], int, str | None]] = [
    ({"model": "nope", "prompt": "hi"}, 404, "model"),
    ({"prompt": "hi"}, 400, "model"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny", "prompt": TOO_LONG}, 400, "prompt"),
    ({"model": "tiny", "prompt": [1, 2, 100000]}, 400, "prompt"),
    ({"model": "tiny", "prompt": {"not": "a prompt"}}, 400, "prompt"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 4000}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ({"model": "tiny", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"model": "tiny", "prompt": "hi", "top_k": -2}, 400, "top_k"),
    ({"model": "tiny", "prompt": "hi", "n": 0}, 400, "n"),
    ({"model": "tiny", "prompt": "hi", "stop": ""}, 400, "stop"),
    ({"model": "tiny", "prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids.0"),
    ({"model": "tiny", "prompt": "hi", "seed": "abc"}, 400, "seed"),
    ({"model": "tiny", "prompt": "hi", "seed": 2**64}, 400, "seed"),  # manual_seed would raise
    ({"model": "tiny", "prompt": "hi", "seed": -(2**63) - 1}, 400, "seed"),
    ({"model": "tiny", "prompt": "hi", "temperature": MAX_TEMPERATURE + 1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "hi", "stop": ["x"] * (MAX_STOP_STRINGS + 1)}, 400, "stop"),
    ({"model": "tiny", "prompt": "hi", "stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, 400, "stop"),
    (
        {"model": "tiny", "prompt": "hi", "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)},
        400,
        "stop_token_ids",
    ),
    # More engine requests (prompts x n) than the whole waiting queue (256): never a 429.
    ({"model": "tiny", "prompt": ["a"] * 17, "n": 16}, 400, "prompt"),
    ({"model": "tiny", "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ({"model": "tiny", "prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ({"model": "tiny", "prompt": "hi", "stream_options": {}}, 400, "stream_options"),
]  # fmt: skip

HI = [{"role": "user", "content": "hi"}]

BAD_CHATS: list[tuple[dict[str, Any], int, str | None]] = [
    ({"model": "tiny", "messages": []}, 400, "messages"),
    ({"model": "tiny"}, 400, "messages"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role"),
    ({"model": "tiny", "messages": [{"role": "user", "content": TOO_LONG}]}, 400, "messages"),
    ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"model": "tiny", "messages": HI, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"model": "tiny", "messages": HI, "max_tokens": 5000}, 400, "max_tokens"),
    ({"model": "tiny", "messages": HI, "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "messages": HI, "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "messages": HI, "seed": 2**63}, 400, "seed"),
    ({"model": "tiny", "messages": HI, "n": MAX_N + 1}, 400, "n"),
    ({"model": "tiny", "messages": HI, "top_logprobs": 1}, 400, "top_logprobs"),
    ({"model": "tiny", "messages": HI, "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    ({"model": "tiny", "messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tool_choice"),  # 'auto' without --tool-call-parser
]  # fmt: skip


def assert_error_shape(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert isinstance(error["message"], str)
    assert error["message"]


@pytest.mark.parametrize(("body", "status", "param"), BAD_COMPLETIONS)
def test_bad_completion_requests(
    worker: Worker, body: dict[str, Any], status: int, param: str | None
) -> None:
    response = httpx.post(f"{worker.base_url}/v1/completions", json=body, timeout=30)
    assert_error_shape(response, status, param)


@pytest.mark.parametrize(("body", "status", "param"), BAD_CHATS)
def test_bad_chat_requests(
    worker: Worker, body: dict[str, Any], status: int, param: str | None
) -> None:
    response = httpx.post(f"{worker.base_url}/v1/chat/completions", json=body, timeout=30)
    assert_error_shape(response, status, param)


@pytest.mark.parametrize("raw", [b'{"model": "tiny", "prompt": "hi",', b"", b"[1, 2"])
def test_malformed_json_is_400(worker: Worker, raw: bytes) -> None:
    response = httpx.post(
        f"{worker.base_url}/v1/completions",
        content=raw,
        headers={"content-type": "application/json"},
    )
    assert_error_shape(response, 400, None)


def test_issue_8_requests_leave_the_worker_serving(worker: Worker, client: openai.OpenAI) -> None:
    # The seed used to be queued before its generator failed, and the worker then died.
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "seed": 18446744073709551616}
    response = httpx.post(f"{worker.base_url}/v1/completions", json=body, timeout=30)
    assert_error_shape(response, 400, "seed")
    # A top_p that is 0 in float32 used to turn the distribution into NaN: now it is greedy.
    messages: Any = [{"role": "user", "content": "hi"}]
    same: Any = {"model": "tiny", "messages": messages, "max_tokens": 6}
    tiny_p = client.chat.completions.create(top_p=5e-324, extra_body={"ignore_eos": True}, **same)
    greedy = client.chat.completions.create(temperature=0, extra_body={"ignore_eos": True}, **same)
    assert tiny_p.choices[0].message.content == greedy.choices[0].message.content
    assert httpx.get(f"{worker.base_url}/health").status_code == 200
    again = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, seed=2**63 - 1)
    assert again.choices[0].finish_reason in ("length", "stop")


def test_openai_client_sees_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="hi", top_p=2.0)
    assert bad.value.status_code == 400
    assert bad.value.param == "top_p"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert missing.value.code == "model_not_found"


def test_metrics_after_traffic(worker: Worker, client: openai.OpenAI) -> None:
    prompt = " ".join([PROMPT] * 4)  # over one 16-token block
    for _ in range(2):  # the second time, the prompt's full blocks are prefix-cache hits
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=5, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
    text = httpx.get(f"{worker.base_url}/metrics").text
    samples = parse_metrics(text)
    labels = 'model_name="tiny",role="both"'

    def value(name: str, extra_label: str = "") -> float:
        return samples[f"{name}{{{extra_label}{labels}}}"]

    gauges = ("num_requests_running", "num_requests_waiting", "prefill_tokens_pending")
    for gauge in (*gauges, "prefill_tokens_waiting"):
        assert value(f"phasefleet_{gauge}") == 0
    assert value("phasefleet_kv_cache_usage_perc") == 0
    # the requests are over, and within the peak gauges' last 30 s
    assert value("phasefleet_num_requests_peak") >= 1
    assert 0 < value("phasefleet_kv_cache_usage_peak_perc") <= 1
    assert value("phasefleet_prompt_tokens_total") >= len(PROMPT.split())
    assert value("phasefleet_generation_tokens_total") >= 5
    assert value("phasefleet_num_preemptions_total") == 0
    queries = value("phasefleet_prefix_cache_queries_total")
    assert 0 < value("phasefleet_prefix_cache_hits_total") <= queries
    for histogram, top in [
        ("time_to_first_token_seconds", "2560.0"),
        ("inter_token_latency_seconds", "80.0"),
        ("time_per_output_token_seconds", "80.0"),
        ("e2e_request_latency_seconds", "7680.0"),
        ("request_queue_time_seconds", "7680.0"),
    ]:
        name = f"phasefleet_{histogram}"
        count = value(f"{name}_count")
        assert count > 0, name
        assert value(f"{name}_bucket", f'le="{top}",') == count
        assert value(f"{name}_bucket", 'le="+Inf",') == count
        assert value(f"{name}_sum") > 0
    startup = {  # phase -> seconds, in the order the phases ran
        k.split('phase="')[1].split('"')[0]: v
        for k, v in samples.items()
        if k.startswith("phasefleet_worker_startup_seconds{")
        and all(label in k for label in labels.split(","))
    }
    assert list(startup)[:4] == ["imports", "model_fetch", "config", "weights"]
    assert list(startup)[-1] == "kv_cache"
    assert startup["imports"] > 0 and startup["weights"] > 0
    assert "# TYPE phasefleet_time_to_first_token_seconds histogram" in text
    assert "# TYPE phasefleet_prompt_tokens_total counter" in text


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_prompt_logprobs_are_transformers(
    client: openai.OpenAI, tokenizer: Any, tiny_model: Path, api: str
) -> None:
    """vLLM's prompt_logprobs: None for the first prompt token, then each token's logprob and
    rank with the k most likely in its place, as transformers' log-softmax over the prompt
    gives them."""
    import torch
    from transformers import AutoModelForCausalLM

    body: dict[str, Any] = {"prompt_logprobs": 2, "return_token_ids": True}
    res: Any
    if api == "completions":
        res = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, extra_body=body)
        got, prompt = (
            extra(res.choices[0], "prompt_logprobs"),
            extra(res.choices[0], "prompt_token_ids"),
        )
    else:
        res = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=1,
            extra_body=body,
        )  # fmt: skip
        got, prompt = extra(res, "prompt_logprobs"), extra(res.choices[0], "prompt_token_ids")
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)  # [n - 1, V]
    assert len(got) == len(prompt) and got[0] is None
    for position, (token, entry) in enumerate(zip(prompt[1:], got[1:], strict=True)):
        row = want[position]
        top = row.topk(2).indices.tolist()
        assert set(entry) == {str(t) for t in (token, *top)}
        mine = entry[str(token)]
        assert abs(mine["logprob"] - row[token].item()) < 1e-4
        assert mine["rank"] == int((row > row[token]).sum()) + 1
        assert mine["decoded_token"] == tokenizer.decode([token])
        assert [entry[str(t)]["rank"] for t in top if t != token] == [
            r for r, t in enumerate(top, start=1) if t != token
        ]
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=1, stream=True, extra_body=body
        )
