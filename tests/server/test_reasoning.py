"""Reasoning parsers (server/reasoning.py): a whole answer's split, and the same split when the
answer streams in pieces of every size."""

from __future__ import annotations

import random

import pytest

from phasefleet.server.reasoning import ReasoningStream, Split, split_reasoning

CASES = [
    # parser, answer, (reasoning, content)
    ("qwen3", "<think>\nIt is Paris.\n</think>\n\nParis.", ("\nIt is Paris.\n", "Paris.")),
    ("qwen3", "  <think>a</think>b", ("a", "b")),
    ("qwen3", "Paris.", (None, "Paris.")),  # thinking off
    ("qwen3", "<thinking is fun", (None, "<thinking is fun")),
    ("qwen3", "<think>cut short while thi", ("cut short while thi", None)),
    ("qwen3", "<think>all thought</think>\n\n", ("all thought", None)),
    ("qwen3", "", (None, "")),
    ("qwen3", "<th", (None, "<th")),
    ("qwen3", "a </think> b", (None, "a </think> b")),  # no thought opened: all content
    ("deepseek_r1", "Let me see.\n</think>\n\n42", ("Let me see.\n", "42")),
    ("deepseek_r1", "<think>\nhmm</think>42", ("\nhmm", "42")),
    ("deepseek_r1", "still thinking when cut", ("still thinking when cut", None)),
    ("deepseek_r1", "x</think", ("x</think", None)),
    ("deepseek_r1", "", ("", None)),
    ("deepseek_r1", "a</think>b</think>c", ("a", "b</think>c")),  # only the first ends it
]  # fmt: skip


@pytest.mark.parametrize(("parser", "answer", "want"), CASES)
def test_a_whole_answer_splits_into_thought_and_content(
    parser: str, answer: str, want: tuple[str | None, str | None]
) -> None:
    assert split_reasoning(parser, answer) == Split(*want)


@pytest.mark.parametrize(("parser", "answer", "want"), CASES)
def test_a_streamed_answer_splits_the_same_in_pieces_of_any_size(
    parser: str, answer: str, want: tuple[str | None, str | None]
) -> None:
    rng = random.Random(0)
    for trial in range(30):
        cuts = sorted(rng.sample(range(1, len(answer)), min(trial % 6, max(0, len(answer) - 1))))
        if trial == 1:
            cuts = list(range(1, len(answer)))  # a character at a time
        pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)], strict=True)]
        stream = ReasoningStream(parser)
        thought, content = "", ""
        for k, piece in enumerate(pieces):
            got = stream.feed(piece, finished=k == len(pieces) - 1)
            thought, content = thought + got[0], content + got[1]
        assert thought == (want[0] or "") and content == (want[1] or ""), pieces


def test_no_tag_text_waits_longer_than_it_must() -> None:
    stream = ReasoningStream("qwen3")
    assert stream.feed("<think>one two", finished=False) == ("one two", "")
    assert stream.feed(" three</th", finished=False) == (" three", "")
    assert stream.feed("ink>\n\nfour", finished=False) == ("", "four")
    assert stream.feed(" five", finished=False) == ("", " five")


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="qwen3"):
        ReasoningStream("granite")
