"""The API surface clients expect beyond plain generation, over real localhost HTTP with the
official openai client where it has the parameter: logprobs (completions and chat, streamed and
not, against transformers' log-softmax on the same weights), echo with prompt logprobs,
min_tokens, /tokenize, /detokenize, /version, a stable /v1/models, and 400s for what is refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch

from phasefleet.server.openai_protocol import ResponsesRequest
from tests.engine.factories import contains
from tests.server.worker_proc import Worker, run_worker

PROMPT = "Evaluation harnesses read the logprobs of every token"
MESSAGES: list[Any] = [{"role": "user", "content": "Say something about tides."}]
TOLERANCE = 1e-4  # nats
SAMPLINGS: list[dict[str, Any]] = [
    {"temperature": 0},
    {"temperature": 1.2, "top_p": 0.9, "seed": 11},
]


@pytest.fixture(scope="module")
def worker(tiny_model: Path) -> Iterator[Worker]:
    """The shared tiny worker, finding Hermes-style tool calls in free text (tool_choice auto)."""
    with run_worker(tiny_model, "--tool-call-parser", "hermes") as w:
        yield w


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Callable[[list[int]], torch.Tensor]:
    """token ids -> [len, V]: transformers' log-softmax at every position (float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return run


def extra(obj: Any, name: str) -> Any:
    return (obj.model_extra or {})[name]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_completion_logprobs_are_transformers_log_softmax(
    client: openai.OpenAI,
    tokenizer: Any,
    reference: Callable[[list[int]], torch.Tensor],
    sampling: dict[str, Any],
) -> None:
    body = {"ignore_eos": True, "return_token_ids": True}
    res = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, logprobs=3, extra_body=body, **sampling
    )
    choice = res.choices[0]
    prompt_ids, output_ids = extra(choice, "prompt_token_ids"), extra(choice, "token_ids")
    expected = reference(prompt_ids + output_ids)[len(prompt_ids) - 1 :]
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.tokens == [tokenizer.decode([t]) for t in output_ids]
    assert logprobs.token_logprobs == pytest.approx(
        [float(expected[i, t]) for i, t in enumerate(output_ids)], abs=TOLERANCE
    )
    assert logprobs.top_logprobs is not None and logprobs.text_offset is not None
    for i, top in enumerate(logprobs.top_logprobs):
        best = expected[i].topk(3)
        # Keyed by text: the chosen token and the three most likely ones.
        shared = [tokenizer.decode([t]) for t in {output_ids[i], *best.indices.tolist()}]
        assert top is not None and set(top) == set(shared)
        for token_id, value in zip(best.indices.tolist(), best.values.tolist(), strict=True):
            text = tokenizer.decode([token_id])
            if shared.count(text) == 1:  # a dict keyed by text cannot hold two "\ufffd"s
                assert top[text] == pytest.approx(value, abs=TOLERANCE)
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(output_ids))]
    assert logprobs.text_offset == offsets

    # The stream carries the same logprobs, token by token.
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, logprobs=3, stream=True, extra_body=body,
        **sampling,
    )  # fmt: skip
    streamed: list[Any] = [c.choices[0].logprobs for c in stream if c.choices]
    assert [t for lp in streamed for t in lp.tokens] == logprobs.tokens
    # (A prefix-cache hit computes the prompt in other batches: float rounding differs.)
    streamed_values = [v for lp in streamed for v in lp.token_logprobs]
    assert streamed_values == pytest.approx(logprobs.token_logprobs, abs=TOLERANCE)
    assert [o for lp in streamed for o in lp.text_offset] == logprobs.text_offset


def test_echo_gives_the_prompt_and_its_logprobs_first_null(
    client: openai.OpenAI, tokenizer: Any, reference: Callable[[list[int]], torch.Tensor]
) -> None:
    prompt_ids = tokenizer.encode(PROMPT)
    res = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    choice = res.choices[0]
    output_ids = extra(choice, "token_ids")
    assert choice.text.startswith(PROMPT)
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None
    n = len(prompt_ids)
    assert logprobs.tokens == [tokenizer.decode([t]) for t in prompt_ids + output_ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = reference(prompt_ids + output_ids)
    want = [float(expected[i - 1, t]) for i, t in enumerate(prompt_ids + output_ids) if i]
    assert logprobs.token_logprobs[1:] == pytest.approx(want, abs=TOLERANCE)
    assert all(top is not None and len(top) >= 2 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset is not None and logprobs.text_offset[n] == len(
        "".join(logprobs.tokens[:n])
    )
    # The same prompt again is computed in full (the prefix cache holds no logits): same answer.
    again = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert again.choices[0].logprobs is not None
    assert again.choices[0].logprobs.tokens == logprobs.tokens
    assert again.choices[0].logprobs.token_logprobs == logprobs.token_logprobs
    # Streamed: the prompt comes first, in the first chunk.
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True,
        stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[0].text.startswith(PROMPT)
    assert "".join(c.text for c in chunks) == choice.text
    streamed: list[Any] = [c.logprobs for c in chunks]
    assert [v for lp in streamed for v in lp.token_logprobs] == logprobs.token_logprobs
    assert [t for lp in streamed for t in lp.tokens] == logprobs.tokens
    # Echo without logprobs: the text only.
    plain = client.completions.create(
        model="tiny", prompt=prompt_ids, max_tokens=3, temperature=0, echo=True
    )
    assert plain.choices[0].text.startswith(tokenizer.decode(prompt_ids))
    assert plain.choices[0].logprobs is None


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled"])
def test_chat_logprobs_are_transformers_log_softmax(
    client: openai.OpenAI,
    tokenizer: Any,
    reference: Callable[[list[int]], torch.Tensor],
    sampling: dict[str, Any],
) -> None:
    body = {"ignore_eos": True, "return_token_ids": True}
    res = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=2,
        extra_body=body, **sampling,
    )  # fmt: skip
    choice = res.choices[0]
    prompt_ids, output_ids = extra(choice, "prompt_token_ids"), extra(choice, "token_ids")
    expected = reference(prompt_ids + output_ids)[len(prompt_ids) - 1 :]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in output_ids]
    for i, (entry, token_id) in enumerate(zip(content, output_ids, strict=True)):
        assert entry.logprob == pytest.approx(float(expected[i, token_id]), abs=TOLERANCE)
        best = expected[i].topk(2)
        assert [t.token for t in entry.top_logprobs] == [
            tokenizer.decode([t]) for t in best.indices.tolist()
        ]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            best.values.tolist(), abs=TOLERANCE
        )
    # Byte-level BPE: each token's own bytes, which together are the output's bytes.
    joined = b"".join(bytes(entry.bytes or []) for entry in content)
    assert joined.decode(errors="replace") == tokenizer.decode(output_ids)
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, logprobs=True, top_logprobs=2,
        stream=True, extra_body=body, **sampling,
    )  # fmt: skip
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in
                c.choices[0].logprobs.content or []]  # fmt: skip
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    # logprobs without top_logprobs: the chosen tokens only.
    bare = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=3, logprobs=True, temperature=0
    )
    assert bare.choices[0].logprobs is not None
    assert [e.top_logprobs for e in bare.choices[0].logprobs.content or []] == [[]] * 3


def test_no_logprobs_unless_asked(client: openai.OpenAI) -> None:
    res = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
    assert res.choices[0].logprobs is None
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert chat.choices[0].logprobs is None


def test_min_tokens_suppresses_stop_tokens_until_reached(client: openai.OpenAI) -> None:
    def run(**body: Any) -> Any:
        return client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
            extra_body={"return_token_ids": True, **body},
        ).choices[0]  # fmt: skip

    greedy = extra(run(ignore_eos=True), "token_ids")
    stopped = run(stop_token_ids=[greedy[0]])
    assert extra(stopped, "token_ids") == [greedy[0]] and stopped.finish_reason == "stop"
    held = run(stop_token_ids=[greedy[0]], min_tokens=4)
    tokens = extra(held, "token_ids")
    assert len(tokens) >= 4 and greedy[0] not in tokens[:4]
    with pytest.raises(openai.BadRequestError) as bad:
        run(min_tokens=11)
    assert bad.value.param == "min_tokens"


def test_tokenize_and_detokenize(worker: Worker, tokenizer: Any) -> None:
    url = worker.base_url
    answer = httpx.post(f"{url}/tokenize", json={"model": "tiny", "prompt": PROMPT}).json()
    ids = tokenizer.encode(PROMPT)
    assert answer == {"count": len(ids), "max_model_len": 2048, "tokens": ids}
    chat = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    assert chat["tokens"] == list(rendered) and chat["count"] == len(rendered)
    back = httpx.post(f"{url}/detokenize", json={"model": "tiny", "tokens": ids}).json()
    assert back == {"prompt": tokenizer.decode(ids)}
    for path, body, param in [
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [10**12]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ]:
        response = httpx.post(f"{url}{path}", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    wrong = httpx.post(f"{url}/tokenize", json={"model": "gpt-4", "prompt": "x"})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"


def test_version_and_a_stable_model_list(worker: Worker, client: openai.OpenAI) -> None:
    from phasefleet.server.tokenize import package_version

    assert httpx.get(f"{worker.base_url}/version").json() == {"version": package_version()}
    first = httpx.get(f"{worker.base_url}/v1/models").json()
    again = httpx.get(f"{worker.base_url}/v1/models").json()
    assert first == again
    [card] = client.models.list().data
    assert (card.id, card.owned_by, extra(card, "root")) == ("tiny", "phasefleet", "tiny")
    assert card.created == first["data"][0]["created"]
    assert "/" not in str(first)  # no host path: the model folder is the host's business


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("completions", {"best_of": 2}, "best_of"),
    # vLLM's extensions this worker does not implement: never silently ignored
    (
        "completions",
        {"extra_body": {"spaces_between_special_tokens": False}},
        "spaces_between_special_tokens",
    ),
    ("completions", {"extra_body": {"use_beam_search": True}}, "use_beam_search"),
    ("completions", {"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
    ("completions", {"extra_body": {"allowed_token_ids": [5, 512]}}, "allowed_token_ids"),
    ("completions", {"extra_body": {"allowed_token_ids": [-1]}}, "allowed_token_ids.0"),
    ("completions", {"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ("chat", {"extra_body": {"bad_words": ["x", "  "]}}, "bad_words"),
    # every allowed token banned: a 400 naming the field, not a failed answer
    (
        "completions",
        {"extra_body": {"allowed_token_ids": [7], "stop_token_ids": [7], "min_tokens": 1}},
        "allowed_token_ids",
    ),
    ("chat", {"extra_body": {"bad_words": [f"w{i}" for i in range(65)]}}, "bad_words"),
    ("chat", {"extra_body": {"priority": 1}}, "priority"),
    ("chat", {"extra_body": {"echo": True}}, "echo"),
    ("chat", {"extra_body": {"chat_template": "{{ messages }}"}}, "chat_template"),
    ("chat", {"extra_body": {"continue_final_message": True}}, "continue_final_message"),
    ("completions", {"suffix": "end"}, "suffix"),
    ("completions", {"logit_bias": {"5": 100.5}}, "logit_bias.5"),
    ("completions", {"logit_bias": {"five": 1.0}}, "logit_bias.five"),
    ("completions", {"logit_bias": {"512": 1.0}}, "logit_bias"),  # past the vocabulary
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("completions", {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ("completions", {"extra_body": {"min_p": 1.5}}, "min_p"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (
        "chat",
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
    ),
    ("chat", {"tool_choice": "required"}, "tool_choice"),  # no tools
    (
        "chat",
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        "tool_choice",
    ),  # two ways at once
    (
        "chat",
        {"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "none"},
        "tools.0.function.name",
    ),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
        "response_format",
    ),  # no schema
    (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"type": "bogus"}},
            }
        },
        "response_format",
    ),
    ("completions", {"extra_body": {"guided_regex": "[0-9"}}, "guided_regex"),
    ("completions", {"extra_body": {"guided_choice": []}}, "guided_choice"),
    ("completions", {"extra_body": {"guided_json": "{not json"}}, "guided_json"),
    (
        "chat",
        {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
        "guided_regex",
    ),  # two ways at once
    (
        "completions",
        {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
        "structured_outputs",
    ),
    (
        "completions",
        {"extra_body": {"structured_outputs": {"grammar": "root ::= ("}}},
        "structured_outputs",
    ),
    ("completions", {"extra_body": {"guided_grammar": ""}}, "guided_grammar"),
    (
        "completions",
        {"extra_body": {"guided_grammar": 'other ::= "a"'}},  # no root rule
        "guided_grammar",
    ),
    ("chat", {"logit_bias": {str(i): 1.0 for i in range(301)}}, "logit_bias"),
]


@pytest.mark.parametrize(("api", "fields", "param"), REFUSED)
def test_refused_fields_get_a_400_naming_them(
    client: openai.OpenAI, api: str, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        if api == "completions":
            client.completions.create(model="tiny", prompt="hi", max_tokens=2, **fields)
        else:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **fields)
    assert bad.value.status_code == 400
    assert bad.value.param == param
    assert param in bad.value.message


def test_logit_bias_and_the_penalties_are_served(client: openai.OpenAI) -> None:
    """OpenAI's logit_bias, presence and frequency penalties and vLLM's repetition_penalty
    and min_p are taken (tests/engine/test_penalties.py checks their arithmetic)."""

    def token_ids(**fields: Any) -> list[int]:
        extra_body = {"return_token_ids": True, **fields.pop("extra_body", {})}
        res = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, extra_body=extra_body,
            **fields,
        )  # fmt: skip
        return list(extra(res.choices[0], "token_ids"))

    assert token_ids(logit_bias={"42": 100}) == [42] * 6
    pushed = token_ids(logit_bias={"42": 100}, frequency_penalty=2.0, presence_penalty=2.0)
    assert pushed == [42] * 6  # 100 - 2 x count - 2 still wins
    assert len(token_ids(extra_body={"repetition_penalty": 1.5, "min_p": 0.3})) == 6
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, logit_bias={"42": 100}, presence_penalty=1.0
    )
    assert chat.choices[0].finish_reason == "length"


def test_allowed_token_ids_and_bad_words_are_served(client: openai.OpenAI, worker: Worker) -> None:
    """vLLM's token restrictions (tests/engine/test_token_rules.py checks them against
    transformers): only allowed tokens are sampled; a banned word's tokens never follow."""

    def token_ids(api: str = "completions", **extra_body: Any) -> list[int]:
        body = {"return_token_ids": True, "ignore_eos": True, **extra_body}
        if api == "chat":
            chat = client.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, extra_body=body
            )
            return list(extra(chat.choices[0], "token_ids"))
        done = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body=body
        )
        return list(extra(done.choices[0], "token_ids"))

    free = token_ids()
    allowed = sorted({free[1], 42, 77})
    restricted = token_ids(allowed_token_ids=allowed)
    assert set(restricted) <= set(allowed) and len(restricted) == 8
    assert set(token_ids("chat", allowed_token_ids=[42])) == {42}
    # a word of the free answer: banned, its token sequences (as written, after a space)
    # never appear, and the answer changes
    post = httpx.Client(base_url=worker.base_url).post
    for token in free:
        word = post("/detokenize", json={"tokens": [token]}).json()["prompt"].strip()
        forms = [
            post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
            for text in (word, " " + word)
        ]
        if word and any(contains(free, form) for form in forms):
            break
    else:
        pytest.fail(f"no token of {free} spells a word that tokenizes back into the answer")
    without = token_ids(bad_words=[word])
    assert without != free and len(without) == 8
    assert not any(contains(without, form) for form in forms)
    assert not any(contains(token_ids("chat", bad_words=[word]), form) for form in forms)


STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def test_responses_text_format_shapes_the_answer(client: openai.OpenAI) -> None:
    """The Responses API's text.format: a json_schema (whole, and streamed) and json_object
    shape the output text as chat's response_format does; another type is a 400."""
    fmt: Any = {
        "type": "json_schema",
        "name": "answer",
        "schema": STRUCTURED_SCHEMA,
        "strict": True,
    }
    whole = client.responses.create(
        model="tiny", input="Say something about tides.", max_output_tokens=40, temperature=0,
        text={"format": fmt},
    )  # fmt: skip
    assert whole.status == "completed"
    assert whole.model_dump()["text"]["format"]["type"] == "json_schema"
    jsonschema.validate(json.loads(whole.output_text), STRUCTURED_SCHEMA)
    stream = client.responses.create(
        model="tiny", input="Say something about tides.", max_output_tokens=40, temperature=0,
        text={"format": fmt}, stream=True,
    )  # fmt: skip
    deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    anything = client.responses.create(
        model="tiny", input="Say something about tides.", max_output_tokens=200, temperature=0,
        text={"format": {"type": "json_object"}},
    )  # fmt: skip
    assert anything.status == "completed", anything.output_text
    assert isinstance(json.loads(anything.output_text), dict)
    xml: Any = {"format": {"type": "xml"}}
    with pytest.raises(openai.BadRequestError, match="text.format.type must be text"):
        client.responses.create(model="tiny", input="Tides?", text=xml)


def test_structured_output_is_served(client: openai.OpenAI) -> None:
    """OpenAI's response_format (json_schema, json_object; chat and completions, streamed and
    not) and vLLM's structured_outputs and guided_* fields constrain what a random model says
    (tests/engine/test_grammar.py checks the masks against transformers)."""
    schema_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": STRUCTURED_SCHEMA, "strict": True},
    }
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=40, temperature=0, response_format=schema_format
    )
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content or ""), STRUCTURED_SCHEMA)
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
        extra_body={"response_format": schema_format},
    )  # fmt: skip
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), STRUCTURED_SCHEMA)
    regex = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=20, temperature=1.0, seed=3,
        extra_body={"structured_outputs": {"regex": "[0-9]{2}-[xyz]{3}"}},
    )  # fmt: skip
    assert re.fullmatch("[0-9]{2}-[xyz]{3}", regex.choices[0].text)
    colors = ["red", "green", "blue"]
    picked = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=10, temperature=1.0, seed=5, n=4,
        extra_body={"guided_choice": colors},
    )  # fmt: skip
    assert all(c.message.content in colors and c.finish_reason == "stop" for c in picked.choices)
    anything = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=200, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert isinstance(json.loads(anything.choices[0].message.content or ""), dict)
    for grammar in ('root ::= "go " ("left" | "right")', 'start: "go " ("left" | "right")'):
        moved = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.0, seed=2,
            extra_body={"structured_outputs": {"grammar": grammar}},
        )  # fmt: skip
        assert moved.choices[0].text in ("go left", "go right"), grammar
    turned = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10,
        extra_body={"guided_grammar": 'root ::= "turn " [0-9]'},
    )  # fmt: skip
    assert re.fullmatch("turn [0-9]", turned.choices[0].text)
    plain = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
        response_format={"type": "text"}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert plain.choices[0].finish_reason == "length"


WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city for the next days",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


def test_a_forced_tool_call_comes_back_as_tool_calls(client: openai.OpenAI) -> None:
    """tool_choice naming a function, or 'required': the answer is a call (or calls) whose
    arguments the tool's schema accepts, as message.tool_calls, streamed or not; 'none' is a
    text answer."""
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    kw: Any = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER, CLOCK], "max_tokens": 60}
    whole = client.chat.completions.create(**kw, tool_choice=named, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), TOOLS["get_weather"])

    chunks = list(
        client.chat.completions.create(**kw, tool_choice=named, temperature=0, stream=True)
    )
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function and deltas[0].function.name == "get_weather"
    assert (
        "".join(d.function.arguments or "" for d in deltas if d.function) == call.function.arguments
    )
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    required = client.chat.completions.create(
        **kw | {"max_tokens": 300}, tool_choice="required", temperature=1.0, seed=7, n=3
    )
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), TOOLS[call.function.name])
    streamed = list(
        client.chat.completions.create(
            **kw | {"max_tokens": 300}, tool_choice="required", temperature=1.0, seed=7, stream=True
        )
    )
    assert len([c for c in streamed if c.choices]) == 2  # the role, then the calls whole
    calls = [d for c in streamed if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in calls if d.function] == [
        (c.function.name, c.function.arguments)
        for c in required.choices[0].message.tool_calls or []
    ]

    cut = client.chat.completions.create(**kw | {"max_tokens": 8}, tool_choice="required")
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls is None
    assert (cut.choices[0].message.content or "").startswith("[")  # the calls so far, as text

    text = client.chat.completions.create(**kw, tool_choice="none", temperature=0)
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content


def test_parallel_tool_calls_false_answers_with_one_call(client: openai.OpenAI) -> None:
    """'required' with parallel_tool_calls false: exactly one call in every choice, where the
    same seeds make lists of several without it; the Responses API passes it on."""
    kw: Any = {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER, CLOCK], "n": 6,
               "max_tokens": 300, "tool_choice": "required", "temperature": 1.0,
               "seed": 3}  # fmt: skip

    def counts(**more: Any) -> list[int]:
        answer = client.chat.completions.create(**kw, **more)
        return [len(c.message.tool_calls or []) for c in answer.choices]

    assert max(counts()) > 1
    assert counts(parallel_tool_calls=False) == [1] * 6
    request = ResponsesRequest.model_validate(
        {"model": "tiny", "input": "?", "tools": [flat(WEATHER)], "parallel_tool_calls": False}
    )
    assert request.as_chat().parallel_tool_calls is False


def test_a_conversation_with_tool_calls_and_results_is_rendered(client: openai.OpenAI) -> None:
    """An earlier answer's tool_calls and the tool's result (role 'tool') go to the chat
    template; the model answers on."""
    messages: Any = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_time", "arguments": '{"zone":"utc"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]  # fmt: skip
    answer = client.chat.completions.create(
        model="tiny", messages=messages, tools=[CLOCK], tool_choice="none", max_tokens=4
    )
    assert answer.choices[0].message.content is not None
    assert answer.usage is not None and answer.usage.prompt_tokens > 20


def flat(tool: Any) -> Any:
    """A chat tool as the Responses API sends it: the function's fields in the tool itself."""
    return {"type": "function", **tool["function"]}


def test_responses_function_tools(client: openai.OpenAI) -> None:
    """The Responses API's function tools: a named or required call comes back as
    function_call items (no message), whole or streamed (a named function's arguments piece by
    piece); 'none' is a message; earlier calls and their outputs in `input` are rendered as chat
    renders them; a hosted tool is a 400 naming it."""
    kw: Any = {"model": "tiny", "input": "Weather?", "tools": [flat(WEATHER), flat(CLOCK)],
               "max_output_tokens": 60, "temperature": 0}  # fmt: skip
    named: Any = {"type": "function", "name": "get_weather"}
    whole = client.responses.create(**kw, tool_choice=named)
    assert whole.status == "completed"
    [call] = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), TOOLS["get_weather"])
    events: list[Any] = list(client.responses.create(**kw, tool_choice=named, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["function_call"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments and done.output_index == 0
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 3 and "".join(pieces) == call.arguments  # as they are generated
    [opened] = [e.item for e in events if e.type == "response.output_item.added"]
    [closed] = [e.item for e in events if e.type == "response.output_item.done"]
    assert opened.id == closed.id and opened.call_id == closed.call_id
    assert events[-1].type == "response.completed"
    assert [i.type for i in events[-1].response.output] == ["function_call"]
    assert events[-1].response.output[0].call_id == closed.call_id

    required = client.responses.create(**kw | {"max_output_tokens": 300}, tool_choice="required")
    assert required.output and all(i.type == "function_call" for i in required.output)
    for item in required.output:
        jsonschema.validate(json.loads(item.arguments), TOOLS[item.name])
    text = client.responses.create(**kw, tool_choice="none")
    assert [i.type for i in text.output] == ["message"] and text.output_text

    conversation: Any = [
        {"role": "user", "content": "What time is it?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_time",
         "arguments": '{"zone":"utc"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
    ]  # fmt: skip
    after = client.responses.create(
        model="tiny", input=conversation, tools=[flat(CLOCK)], tool_choice="none",
        max_output_tokens=4,
    )  # fmt: skip
    plain = client.responses.create(
        model="tiny", input=conversation[:1], tools=[flat(CLOCK)], tool_choice="none",
        max_output_tokens=4,
    )  # fmt: skip
    assert after.status in ("completed", "incomplete") and after.output_text
    assert after.usage is not None and plain.usage is not None
    assert after.usage.input_tokens > plain.usage.input_tokens + 10  # the call and its output
    hosted: Any = [{"type": "web_search"}]
    with pytest.raises(openai.BadRequestError, match="only function tools") as bad:
        client.responses.create(model="tiny", input="hi", tools=hosted)
    assert bad.value.param == "tools[0].type"


def test_tool_choice_auto_finds_the_calls_in_the_text(client: openai.OpenAI) -> None:
    """With --tool-call-parser hermes, 'auto' answers in free text and the calls written in it
    come back as tool_calls, the rest as content, whole or streamed. The random model is made to
    write a call by a one-string guided_choice."""
    written = 'Checking.<tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}</tool_call>'
    kw: Any = {
        "model": "tiny", "messages": MESSAGES, "tools": [WEATHER, CLOCK], "max_tokens": 80,
        "extra_body": {"guided_choice": [written]},
    }  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking."
    [call] = whole.message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_time",
        {"zone": "cet"},
    )

    chunks = list(client.chat.completions.create(**kw, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert content == "Checking." and len(calls) == 1 and calls[0].id
    assert calls[0].function and calls[0].function.arguments == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    plain = client.chat.completions.create(**kw | {"extra_body": {"guided_choice": ["no call"]}})
    assert plain.choices[0].message.content == "no call"
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"
