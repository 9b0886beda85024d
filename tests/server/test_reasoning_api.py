"""--reasoning-parser over real HTTP with the official openai client: a model that writes a
<think> block (a tiny one trained to) gets its thought back as `reasoning_content` and the rest
as `content`, whole or streamed; a grammar shapes the content after the thought."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.server.trained import train_to_answer
from tests.server.worker_proc import Worker, run_worker

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "<think>\nIt is Paris.\n</think>\n\nParis."


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from phasefleet.engine.tiny import make_tiny

    folder = make_tiny(tmp_path_factory.mktemp("models") / "thinker", arch="qwen3", seed=7)
    return train_to_answer(folder, MESSAGES, ANSWER)


@pytest.fixture(scope="module")
def worker(thinker: Path) -> Iterator[Worker]:
    with run_worker(thinker, "--reasoning-parser", "qwen3") as w:
        yield w


def ask(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_completion_tokens=32,
        temperature=0,
        **kw,
    )


def test_the_thought_comes_back_apart_from_the_answer(worker: Worker, thinker: Path) -> None:
    from transformers import AutoTokenizer

    chat = ask(worker.client(), extra_body={"return_token_ids": True})
    choice = chat.choices[0]
    written = AutoTokenizer.from_pretrained(thinker).decode(choice.model_extra["token_ids"])
    assert written == ANSWER + "<|im_end|>"  # what the model wrote, tags and all
    assert choice.message.content == "Paris."
    assert (choice.message.model_extra or {})["reasoning_content"] == "\nIt is Paris.\n"
    assert choice.finish_reason == "stop"


def test_a_stream_sends_the_thought_first_then_the_answer(worker: Worker) -> None:
    parts: list[tuple[str, str]] = []
    for chunk in ask(worker.client(), stream=True):
        for choice in chunk.choices:
            thought = (choice.delta.model_extra or {}).get("reasoning_content")
            if thought:
                parts.append(("thought", thought))
            if choice.delta.content:
                parts.append(("content", choice.delta.content))
    kinds = [kind for kind, _ in parts]
    assert kinds == sorted(kinds, reverse=True)  # every thought piece before any content
    assert "".join(text for kind, text in parts if kind == "thought") == "\nIt is Paris.\n"
    assert "".join(text for kind, text in parts if kind == "content") == "Paris."
    assert all("<" not in text for _, text in parts)  # no tag reaches the client


def test_a_grammar_shapes_the_answer_after_the_thought(worker: Worker) -> None:
    """Structured output starts once the thought ends (as vLLM's): the model thinks freely,
    then its content matches the grammar, whole or streamed; when the prompt closes the thought
    already (enable_thinking false), from the first token."""
    regex = {"structured_outputs": {"regex": "Paris|Rome"}}
    chat = ask(worker.client(), extra_body=regex)
    message = chat.choices[0].message
    assert message.content == "Paris" and chat.choices[0].finish_reason == "stop"
    assert (message.model_extra or {})["reasoning_content"] == "\nIt is Paris.\n"
    pieces = {"reasoning_content": "", "content": ""}
    for chunk in ask(worker.client(), extra_body=regex, stream=True):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            for key in pieces:
                pieces[key] += delta.get(key) or ""
    assert pieces == {"reasoning_content": "\nIt is Paris.\n", "content": "Paris"}
    closed = ask(
        worker.client(),
        extra_body={**regex, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert closed.choices[0].message.content in ("Paris", "Rome")
    assert not (closed.choices[0].message.model_extra or {}).get("reasoning_content")


def test_the_responses_api_gives_the_thought_its_own_item(worker: Worker) -> None:
    """OpenAI's Responses API on the same model: a reasoning item, then the message; the
    answer ended on its own (status completed); streamed, the same items in the same order,
    the thought as it comes (reasoning_text deltas), closed before the answer's text."""
    client = worker.client()
    whole = client.responses.create(model="tiny", input=MESSAGES[0]["content"], temperature=0)
    assert whole.status == "completed" and whole.incomplete_details is None
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "\nIt is Paris.\n"  # type: ignore[union-attr,index]
    assert whole.output_text == "Paris."
    chat = ask(client)
    assert whole.usage is not None and chat.usage is not None
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens

    stream: Any = client.responses.create(
        model="tiny",
        input=MESSAGES,  # type: ignore[arg-type]
        temperature=0,
        stream=True,
    )
    events: list[Any] = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == "Paris." and events[-1].type == "response.completed"
    assert events[-1].response.output_text == "Paris."
    kinds = [e.type for e in events]
    thought = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert len(thought) > 1 and "".join(e.delta for e in thought) == "\nIt is Paris.\n"
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert events[-1].response.output[0].content[0].text == "\nIt is Paris.\n"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input"),
        ({"tools": [{"type": "function", "parameters": {}}]}, "tools.0.name"),
    ],
)
def test_what_the_responses_api_does_not_serve_is_a_400_naming_it(
    worker: Worker, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        worker.client().responses.create(**{"model": "tiny", "input": "hi", **fields})
    assert bad.value.param == param
