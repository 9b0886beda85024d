"""Speculative decoding on a real worker (`--num-speculative-tokens`): through the official
client, greedy and seeded sampled answers are those of a worker without it, whole and streamed,
while drafts are verified (its counters on /metrics say so)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from phasefleet.api.contract import Metric
from tests.server.worker_proc import WORKER_COMMAND, Worker, parse_metrics, run_worker

# Text that repeats itself: the last tokens recur, so prompt lookup finds drafts
PROMPTS = [
    "one two three four one two three four one two three four one two",
    "The sea is wide, the sea is deep. The sea is wide, the sea is",
    "Count: 1 2 3 4 5 6 7 8 9 10, 1 2 3 4 5 6 7 8 9 10, 1 2 3",
]


@pytest.fixture(scope="module")
def workers(tiny_model: Path) -> Iterator[tuple[Worker, Worker]]:
    args = ("--num-speculative-tokens", "4", "--prompt-lookup-min", "1")
    with run_worker(tiny_model, *args) as drafting, run_worker(tiny_model) as plain:
        yield drafting, plain


SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 5}


def client_of(worker: Worker) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{worker.base_url}/v1", api_key="x", timeout=60)


def answers(worker: Worker, stream: bool, sampling: dict[str, float] | None = None) -> list[str]:
    client = client_of(worker)
    texts = []
    for prompt in PROMPTS:
        kw = dict(model="tiny", prompt=prompt, max_tokens=40, **(sampling or {"temperature": 0}))
        if stream:
            chunks = client.completions.create(**kw, stream=True)  # type: ignore[call-overload]
            texts.append("".join(c.choices[0].text for c in chunks if c.choices))
        else:
            texts.append(client.completions.create(**kw).choices[0].text)  # type: ignore[call-overload]
    return texts


def counter(worker: Worker, name: str) -> float:
    metrics = parse_metrics(httpx.get(f"{worker.base_url}/metrics", timeout=10).text)
    return sum(v for key, v in metrics.items() if key.startswith(name))


def test_drafted_resultsequal_plain_greedy_ones(workers: tuple[Worker, Worker]) -> None:
    drafting, plain = workers
    expected = answers(plain, stream=False)
    assert answers(drafting, stream=False) == expected
    assert answers(drafting, stream=True) == expected
    assert answers(drafting, False, SEEDED) == answers(plain, False, SEEDED)
    drafts = counter(drafting, Metric.SPEC_DECODE_DRAFT_TOKENS_TOTAL)
    accepted = counter(drafting, Metric.SPEC_DECODE_ACCEPTED_TOKENS_TOTAL)
    assert drafts > 0 and 0 <= accepted <= drafts
    assert counter(plain, Metric.SPEC_DECODE_DRAFT_TOKENS_TOTAL) == 0


def test_a_bad_speculation_setting_stops_the_worker_with_the_field(tiny_model: Path) -> None:
    import subprocess

    result = subprocess.run(
        [*WORKER_COMMAND, "--model", str(tiny_model), "--num-speculative-tokens", "40"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "num_speculative_tokens must be in [0, 16]" in result.stderr


def test_a_stop_string_ends_a_drafting_answer_where_it_ends_a_plain_one(
    workers: tuple[Worker, Worker],
) -> None:
    """A stop string taken from the middle of each plain answer: the text, the finish reason
    and the completion token count are the plain worker's."""
    drafting, plain = workers
    drafted = counter(drafting, Metric.SPEC_DECODE_DRAFT_TOKENS_TOTAL)
    seen = []
    for prompt, text in zip(PROMPTS, answers(plain, stream=False), strict=True):
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        assert stop.strip(), text
        results = []
        for worker in (drafting, plain):
            client = client_of(worker)
            c = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=[stop]
            )
            assert c.usage is not None
            results.append(
                (c.choices[0].text, c.choices[0].finish_reason, c.usage.completion_tokens)
            )
        assert results[0] == results[1]
        seen.append(results[1][1])
    assert "stop" in seen
    assert counter(drafting, Metric.SPEC_DECODE_DRAFT_TOKENS_TOTAL) > drafted  # they drafted


def test_logprobs_of_a_drafting_answer_are_those_of_a_plain_one(
    workers: tuple[Worker, Worker],
) -> None:
    """Each accepted draft token reports the logprobs drawn at its position."""
    drafting, plain = workers
    drafted = counter(drafting, Metric.SPEC_DECODE_DRAFT_TOKENS_TOTAL)
    got = []
    for worker in (drafting, plain):
        client = client_of(worker)
        c = client.completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=30, temperature=0, logprobs=2
        )
        got.append(c.choices[0].logprobs)
    (mine, theirs) = got
    assert mine is not None and theirs is not None
    assert mine.tokens == theirs.tokens and len(mine.tokens or []) == 30
    assert mine.token_logprobs == pytest.approx(theirs.token_logprobs, abs=1e-4)
    assert [sorted(t) for t in mine.top_logprobs or []] == [
        sorted(t) for t in theirs.top_logprobs or []
    ]
    assert counter(drafting, Metric.SPEC_DECODE_DRAFT_TOKENS_TOTAL) > drafted


def test_structured_resultsof_a_drafting_worker_are_those_of_a_plain_one(
    workers: tuple[Worker, Worker],
) -> None:
    """A regex and a JSON schema (vLLM's structured_outputs) on a prompt that repeats what the
    answer writes: the drafting worker drafts under the grammar and answers as the plain one."""
    drafting, plain = workers
    drafted = counter(drafting, Metric.SPEC_DECODE_DRAFT_TOKENS_TOTAL)
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 8}},
        "required": ["a", "b"],
    }
    prompt = 'abab-abab-abab {"a": 12, "b": "abab"} {"a": 12, "b": "abab"} {"a": 12'
    texts = []
    for worker in (drafting, plain):
        client = client_of(worker)
        results = []
        for structured in ({"regex": "(ab){1,12}-(ab){1,12}"}, {"json": schema}):
            c = client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=40,
                temperature=0,
                extra_body={"structured_outputs": structured},
            )
            results.append((c.choices[0].text, c.choices[0].finish_reason))
        texts.append(results)
    assert texts[0] == texts[1]
    assert counter(drafting, Metric.SPEC_DECODE_DRAFT_TOKENS_TOTAL) > drafted
