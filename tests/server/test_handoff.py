"""The KV hand-off between real worker processes over real HTTP: a decode worker told (by the
router's headers) to prefill on a prefill worker receives the prompt's KV streamed from it, and
whatever fails on the way, it answers the request itself, token for token the same."""

from __future__ import annotations

import http.server
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from phasefleet.api.contract import (
    INTERNAL_TOKEN_ENV,
    INTERNAL_TOKEN_HEADER,
    PREFILL_BACKLOG_HEADER,
    PREFILL_SPEED_HEADER,
    PREFILL_URL_HEADER,
)
from phasefleet.server.kv_wire import MIN_WIRE_VERSION, WIRE_VERSION
from tests.server.worker_proc import Worker, run_worker

TOKEN = "test-internal-token"
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 3,  # several blocks
    "Tell me about the sea",  # under one block of 16
    "one two three four five six seven eight nine ten eleven twelve",
]


@pytest.fixture(scope="module")
def workers(tiny_model: Path) -> Iterator[tuple[Worker, Worker, Worker]]:
    """(prefill, decode, aggregated reference), the first two sharing the internal token."""
    mp = pytest.MonkeyPatch()
    mp.setenv(INTERNAL_TOKEN_ENV, TOKEN)
    args = ("--num-kv-blocks", "64", "--kv-lease-seconds", "3")
    try:
        with (
            run_worker(tiny_model, "--role", "prefill", *args) as prefill,
            run_worker(
                tiny_model, "--role", "decode", "--remote-prefill-min-tokens", "0", *args
            ) as decode,
        ):
            mp.delenv(INTERNAL_TOKEN_ENV)
            with run_worker(tiny_model, "--num-kv-blocks", "64") as reference:
                yield prefill, decode, reference
    finally:
        mp.undo()


def handoff_client(decode: Worker, prefill_url: str, token: str = TOKEN) -> openai.OpenAI:
    """What the router sends a decode worker: the prefill worker it picked, and the token."""
    headers = {PREFILL_URL_HEADER: prefill_url, INTERNAL_TOKEN_HEADER: token}
    return openai.OpenAI(
        base_url=f"{decode.base_url}/v1",
        api_key="unused",
        max_retries=0,
        timeout=60,
        default_headers=headers,
    )


def complete(client: openai.OpenAI, prompt: str, stream: bool = False) -> str:
    if not stream:
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        return out.choices[0].text
    chunks = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True
    )
    return "".join(c.choices[0].text for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True])
def test_remote_prefill_output_equals_a_single_worker(
    workers: tuple[Worker, Worker, Worker], stream: bool
) -> None:
    prefill, decode, reference = workers
    remote_before = decode.counter("phasefleet_prefills_total", where="remote")
    bytes_before = decode.counter("phasefleet_kv_transfer_bytes_total")
    computed_before = decode.counter("phasefleet_prompt_tokens_total")
    client = handoff_client(decode, prefill.base_url)
    for prompt in PROMPTS:
        assert complete(client, prompt, stream) == complete(reference.client(), prompt, stream)
    assert decode.counter("phasefleet_prefills_total", where="remote") == remote_before + 3
    assert decode.counter("phasefleet_prompt_tokens_total") == computed_before  # all imported
    assert decode.counter("phasefleet_kv_transfer_bytes_total") > bytes_before
    assert decode.counter("phasefleet_kv_transfer_failures_total") == 0
    prefill.wait_until(lambda: prefill.counter("phasefleet_kv_leases") == 0)  # all released


def test_chat_through_a_hand_off_equals_a_single_worker(
    workers: tuple[Worker, Worker, Worker],
) -> None:
    prefill, decode, reference = workers
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Write a line about the moon and the tide"}
    ]
    answers = [
        c.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
        for c in (handoff_client(decode, prefill.base_url), reference.client())
    ]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    assert answers[0].usage == answers[1].usage


def test_bias_penalties_and_min_p_cross_the_hand_off(
    workers: tuple[Worker, Worker, Worker],
) -> None:
    """The prefill worker samples the first token with the request's bias, repetition penalty
    and min-p (wire version 2) and allowed tokens (version 6), the decode worker the rest with
    its penalties too: the same tokens as one worker, greedy and seeded."""
    prefill, decode, reference = workers
    remote_before = decode.counter("phasefleet_prefills_total", where="remote")
    settings: list[dict[str, Any]] = [
        {"temperature": 0, "logit_bias": {"42": 100}},  # every token 42, the first one too
        {"temperature": 0, "logit_bias": {"42": 8}, "frequency_penalty": 2.0},
        {
            "temperature": 0.8, "seed": 11, "presence_penalty": 1.0, "frequency_penalty": 0.5,
            "extra_body": {"repetition_penalty": 1.8, "min_p": 0.2},
        },
        # wire version 6: the first token (the prefill worker's) is one of these too
        {"temperature": 0, "extra_body": {"allowed_token_ids": [42, 77]}},
    ]  # fmt: skip

    def token_ids(client: openai.OpenAI, setting: dict[str, Any]) -> list[int]:
        fields = {k: v for k, v in setting.items() if k != "extra_body"}
        extra = {"return_token_ids": True, **setting.get("extra_body", {})}
        out = client.completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=8, extra_body=extra, **fields
        )
        return list(out.choices[0].token_ids)

    clients = (handoff_client(decode, prefill.base_url), reference.client())
    answers = [[token_ids(client, setting) for setting in settings] for client in clients]
    assert answers[0] == answers[1]
    assert answers[0][0] == [42] * 8
    assert answers[0][1] != answers[0][0]  # the penalty pushes 42 back
    assert set(answers[0][3]) <= {42, 77}
    assert decode.counter("phasefleet_prefills_total", where="remote") == remote_before + 4


def test_structured_output_crosses_the_hand_off(workers: tuple[Worker, Worker, Worker]) -> None:
    """The prefill worker samples the first token under the request's grammar (wire version 3),
    the decode worker the rest from that token on: the same answers as one worker, each obeying
    its grammar."""
    prefill, decode, reference = workers
    remote_before = decode.counter("phasefleet_prefills_total", where="remote")
    schema = {
        "type": "object",
        "properties": {"word": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
        "required": ["word", "n"],
        "additionalProperties": False,
    }
    settings: list[dict[str, Any]] = [
        {"temperature": 0, "response_format": {"type": "json_schema",
                                               "json_schema": {"name": "a", "schema": schema}}},
        {"temperature": 0.9, "seed": 4, "guided_choice": ["sun", "moon", "tide"]},
        {"temperature": 0.9, "seed": 5, "guided_regex": "[0-9]{4}"},
    ]  # fmt: skip

    def text(client: openai.OpenAI, setting: dict[str, Any]) -> str:
        fields = {k: v for k, v in setting.items() if k in ("temperature", "seed")}
        extra = {k: v for k, v in setting.items() if k not in fields}
        out = client.completions.create(
            model="tiny", prompt=PROMPTS[1], max_tokens=40, extra_body=extra, **fields
        )
        assert out.choices[0].finish_reason == "stop"
        return out.choices[0].text

    clients = (handoff_client(decode, prefill.base_url), reference.client())
    answers = [[text(client, setting) for setting in settings] for client in clients]
    assert answers[0] == answers[1]
    document, choice, digits = answers[0]
    assert set(json.loads(document)) == {"word", "n"}
    assert choice in ("sun", "moon", "tide") and re.fullmatch("[0-9]{4}", digits)
    assert decode.counter("phasefleet_prefills_total", where="remote") == remote_before + 3


def test_internal_endpoints_refuse_a_missing_or_wrong_token(
    workers: tuple[Worker, Worker, Worker],
) -> None:
    prefill, _, _ = workers
    body = {"request_id": "x", "prompt_token_ids": [5, 6, 7], "max_tokens": 4}
    for headers in ({}, {INTERNAL_TOKEN_HEADER: "wrong"}):
        response = httpx.post(
            prefill.base_url + "/internal/prefill", json=body, headers=headers, timeout=10
        )
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_internal_token"
    assert prefill.counter("phasefleet_kv_leases") == 0  # nothing was prefilled


def test_a_wrong_token_means_no_remote_prefill(workers: tuple[Worker, Worker, Worker]) -> None:
    """A client cannot make a decode worker call a URL of its choosing."""
    prefill, decode, reference = workers
    local_before = decode.counter("phasefleet_prefills_total", where="local")
    client = handoff_client(decode, "http://127.0.0.1:9/nowhere", token="wrong")
    assert complete(client, PROMPTS[0]) == complete(reference.client(), PROMPTS[0])
    assert decode.counter("phasefleet_prefills_total", where="local") == local_before + 1


def test_unreachable_prefill_worker_means_a_local_prefill(
    workers: tuple[Worker, Worker, Worker],
) -> None:
    _, decode, reference = workers
    before = decode.counter("phasefleet_kv_transfer_failures_total", reason="prefill_unreachable")
    client = handoff_client(decode, "http://127.0.0.1:9")
    assert complete(client, PROMPTS[2], stream=True) == complete(
        reference.client(), PROMPTS[2], stream=True
    )
    after = decode.counter("phasefleet_kv_transfer_failures_total", reason="prefill_unreachable")
    assert after == before + 1


def test_a_decode_pool_of_another_block_size_converts_the_kv(
    workers: tuple[Worker, Worker, Worker], tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pools rolled separately: the prefill worker's blocks of 16 load into blocks of 32; the
    decode worker recomputes nothing and answers as a single worker does."""
    prefill, _, reference = workers
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, TOKEN)
    with run_worker(
        tiny_model, "--role", "decode", "--remote-prefill-min-tokens", "0", "--block-size", "32"
    ) as decode:
        client = handoff_client(decode, prefill.base_url)
        for prompt in PROMPTS:
            assert complete(client, prompt) == complete(reference.client(), prompt)
        assert decode.counter("phasefleet_prefills_total", where="remote") == len(PROMPTS)
        assert decode.counter("phasefleet_kv_transfer_failures_total") == 0
        assert decode.counter("phasefleet_prompt_tokens_total") == 0


def test_the_phase_boundary_follows_the_prefill_workers_backlog(
    workers: tuple[Worker, Worker, Worker], tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode worker with the adaptive boundary (threshold 200 tokens): the backlog the router
    sends moves a 300-token prompt here while the prefill worker is behind, and a 150-token one
    there while it is idle; with no backlog sent the threshold decides. Answers never change."""
    prefill, _, reference = workers
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, TOKEN)
    long, short = list(range(3, 303)), list(range(5, 155))  # token ids: 300 and 150 tokens
    cases = [  # (prompt, backlog header, where it is prefilled, the move)
        (long, "5000", "local", "local"),  # backlogged: this worker has room
        (long, "100", "remote", None),  # behind, under 0.5 s: the threshold
        (short, "0", "remote", "remote"),  # idle: from 128 tokens
        (short, None, "local", None),  # not measured: the threshold
    ]
    with run_worker(
        tiny_model, "--role", "decode", "--remote-prefill-min-tokens", "200",
        "--adaptive-phase-boundary", "--num-kv-blocks", "64", "--no-prefix-caching",
    ) as decode:  # fmt: skip
        for prompt, backlog, where, moved in cases:
            headers = {PREFILL_URL_HEADER: prefill.base_url, INTERNAL_TOKEN_HEADER: TOKEN}
            if backlog is not None:
                headers[PREFILL_BACKLOG_HEADER] = backlog
                headers[PREFILL_SPEED_HEADER] = "2000"  # prompt tokens/s
            before = {
                w: decode.counter("phasefleet_prefills_total", where=w) for w in ("local", "remote")
            }
            moves = {
                t: decode.counter("phasefleet_phase_boundary_moves_total", to=t)
                for t in ("local", "remote")
            }
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
            got = httpx.post(
                f"{decode.base_url}/v1/completions", json=body, headers=headers, timeout=60
            )
            want = reference.client().completions.create(
                model="tiny", prompt=prompt, max_tokens=6, temperature=0
            )
            assert got.status_code == 200, got.text
            assert got.json()["choices"][0]["text"] == want.choices[0].text
            assert decode.counter("phasefleet_prefills_total", where=where) == before[where] + 1, (
                backlog,
                where,
            )
            for to in ("local", "remote"):
                expected = moves[to] + (1 if to == moved else 0)
                assert decode.counter("phasefleet_phase_boundary_moves_total", to=to) == expected, (
                    backlog,
                    to,
                )


class HoldKV(http.server.BaseHTTPRequestHandler):
    """A proxy to the prefill worker that forwards the first bytes of a KV stream, says so, waits
    until the test has killed the worker, then hangs up: a worker dead mid-stream, every time."""

    protocol_version = "HTTP/1.1"
    upstream = ""
    streaming = threading.Event()
    killed = threading.Event()

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers["content-length"]))
        with httpx.stream(
            "POST", self.upstream + self.path, content=body, headers=dict(self.headers), timeout=60
        ) as response:
            self.send_response(response.status_code)
            self.send_header("content-type", response.headers["content-type"])
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            first = next(response.iter_raw())
            self.wfile.write(b"%x\r\n%s\r\n" % (len(first), first))  # no terminating chunk
            self.wfile.flush()
            self.streaming.set()
            self.killed.wait(60)
        self.close_connection = True

    def log_message(self, *_: object) -> None:
        pass


def test_a_prefill_worker_killed_mid_stream_means_a_local_prefill(
    workers: tuple[Worker, Worker, Worker], tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL (as the OOM killer sends it) while the prefill worker streams a long prompt in
    chunks of 16 tokens, after some of its KV went out: the decode worker answers in full."""
    _, decode, reference = workers
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, TOKEN)
    prompt = [5 + (i * 7) % 500 for i in range(900)]  # 57 of the 64 blocks of the others
    with run_worker(tiny_model, "--role", "prefill", "--max-num-batched-tokens", "16") as doomed:
        streaming, killed = threading.Event(), threading.Event()
        handler = type(
            "Hold",
            (HoldKV,),
            {"upstream": doomed.base_url, "streaming": streaming, "killed": killed},
        )
        proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        try:
            before = decode.counter("phasefleet_kv_transfer_failures_total")
            client = handoff_client(decode, f"http://127.0.0.1:{proxy.server_address[1]}")
            answer: list[str] = []
            asking = threading.Thread(
                target=lambda: answer.append(
                    client.completions.create(
                        model="tiny", prompt=prompt, max_tokens=8, temperature=0
                    )
                    .choices[0]
                    .text
                )
            )
            asking.start()
            assert streaming.wait(60)
            doomed.proc.kill()
            doomed.proc.wait(30)
            killed.set()
            asking.join(120)
        finally:
            proxy.shutdown()
    expected = reference.client().completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0
    )
    assert answer == [expected.choices[0].text]
    assert decode.counter("phasefleet_kv_transfer_failures_total") == before + 1


class CutKV(http.server.BaseHTTPRequestHandler):
    """A proxy to the prefill worker that forwards the first half of every KV stream (past its
    first token), then hangs up."""

    protocol_version = "HTTP/1.1"
    upstream = ""

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers["content-length"]))
        response = httpx.post(
            self.upstream + self.path, content=body, headers=dict(self.headers), timeout=60
        )
        self.send_response(response.status_code)
        self.send_header("content-type", response.headers["content-type"])
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        half = response.content[: len(response.content) // 2]
        self.wfile.write(b"%x\r\n%s\r\n" % (len(half), half))  # no terminating chunk
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *_: object) -> None:
        pass


def test_a_stream_cut_halfway_is_recomputed(workers: tuple[Worker, Worker, Worker]) -> None:
    prefill, decode, reference = workers
    handler = type("Cut", (CutKV,), {"upstream": prefill.base_url})
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        before = decode.counter("phasefleet_kv_transfer_failures_total")
        client = handoff_client(decode, f"http://127.0.0.1:{proxy.server_address[1]}")
        for stream in (False, True):
            assert complete(client, PROMPTS[0], stream) == complete(
                reference.client(), PROMPTS[0], stream
            )
        assert decode.counter("phasefleet_kv_transfer_failures_total") == before + 2
    finally:
        proxy.shutdown()
    prefill.wait_until(lambda: prefill.counter("phasefleet_kv_leases") == 0)


def test_a_stream_cut_before_the_first_token_uses_what_arrived(
    workers: tuple[Worker, Worker, Worker], tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt prefilled in chunks of one block streams each block as it is computed; cut
    halfway, before the first token: the decode worker keeps the blocks that came, computes
    the rest and samples the first token itself."""
    _, decode, reference = workers
    monkeypatch.setenv(INTERNAL_TOKEN_ENV, TOKEN)
    prompt = [5 + (i * 11) % 500 for i in range(200)]  # 13 chunks: the first token comes last
    with run_worker(tiny_model, "--role", "prefill", "--max-num-batched-tokens", "16") as slow:
        handler = type("Cut", (CutKV,), {"upstream": slow.base_url})
        proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        try:
            failed = decode.counter("phasefleet_kv_transfer_failures_total")
            local = decode.counter("phasefleet_prefills_total", where="local")
            computed = decode.counter("phasefleet_prompt_tokens_total")
            client = handoff_client(decode, f"http://127.0.0.1:{proxy.server_address[1]}")
            answer = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=8, temperature=0
            )
        finally:
            proxy.shutdown()
    expected = reference.client().completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0
    )
    assert answer.choices[0].text == expected.choices[0].text
    assert decode.counter("phasefleet_kv_transfer_failures_total") == failed + 1
    assert decode.counter("phasefleet_prefills_total", where="local") == local + 1
    recomputed = decode.counter("phasefleet_prompt_tokens_total") - computed
    assert 0 < recomputed < len(prompt) - 16  # blocks arrived before the cut were not computed
    decode.wait_until(lambda: decode.metric("phasefleet_kv_cache_usage_perc") == 0)


def test_a_decode_worker_that_goes_away_leaves_no_blocks_behind(
    workers: tuple[Worker, Worker, Worker],
) -> None:
    """Once after the start of the stream, once after the first token (the prompt's KV is
    leased by then): no block is left behind, and no lease had to expire to free it."""
    prefill, _, _ = workers
    headers = {INTERNAL_TOKEN_HEADER: TOKEN}
    body = {"request_id": "abandoned", "prompt_token_ids": list(range(5, 45)), "max_tokens": 8}
    expiries = prefill.counter("phasefleet_kv_lease_expiries_total")
    for leave_after in (b"", b'"first_token_id"'):
        with httpx.stream(
            "POST", prefill.base_url + "/internal/prefill", json=body, headers=headers, timeout=60
        ) as answer:
            assert answer.status_code == 200
            seen = b""
            for chunk in answer.iter_raw(8):
                seen += chunk
                if leave_after in seen:
                    break
        prefill.wait_until(lambda: prefill.counter("phasefleet_kv_leases") == 0, 15)
        prefill.wait_until(lambda: prefill.counter("phasefleet_kv_cache_usage_perc") == 0, 15)
    assert prefill.counter("phasefleet_kv_lease_expiries_total") == expiries


def test_a_bad_prefill_request_is_a_400_naming_the_field(
    workers: tuple[Worker, Worker, Worker],
) -> None:
    prefill, _, _ = workers
    headers = {INTERNAL_TOKEN_HEADER: TOKEN}
    good = {"request_id": "bad", "prompt_token_ids": [5, 6, 7], "max_tokens": 4}
    for change, field in (
        ({"temperature": -1.0}, "temperature"),
        ({"prompt_token_ids": [10**9]}, "prompt_token_ids"),
        ({"wire_version": 2, "logit_bias": {"100000": 1.0}}, "logit_bias"),  # past the vocabulary
        ({"wire_version": 2, "repetition_penalty": 0}, "repetition_penalty"),
        ({"wire_version": 3, "grammar": {"kind": "regex", "spec": "[0-9"}}, "grammar"),
        ({"wire_version": 6, "allowed_token_ids": [5, 100000]}, "allowed_token_ids"),
        ({"wire_version": 6, "bad_words": [[5], []]}, "bad_words.1"),
    ):
        answer = httpx.post(
            prefill.base_url + "/internal/prefill",
            json={**good, **change},
            headers=headers,
            timeout=30,
        )
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == field
    assert prefill.counter("phasefleet_kv_leases") == 0


def test_a_later_field_is_served_and_another_wire_version_is_a_409(
    workers: tuple[Worker, Worker, Worker],
) -> None:
    """A decode worker of a later release (more fields) is served, and one of an earlier wire
    version still answered in it; a version past this worker's is refused before anything is
    prefilled (server/kv_wire.py's version rules)."""
    prefill, _, _ = workers
    headers = {INTERNAL_TOKEN_HEADER: TOKEN}
    body = {"request_id": "v", "prompt_token_ids": [5, 6, 7], "max_tokens": 4}
    url = prefill.base_url + "/internal/prefill"
    for extra in ({"a_later_field": 1}, {"wire_version": MIN_WIRE_VERSION}):
        with httpx.stream("POST", url, json={**body, **extra}, headers=headers) as answer:
            assert answer.status_code == 200
            assert answer.read()  # the whole stream, so its blocks are let go
    later = {**body, "wire_version": WIRE_VERSION + 1}
    answer = httpx.post(url, json=later, headers=headers, timeout=30)
    assert answer.status_code == 409, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("wire_version_mismatch", "wire_version")
    assert "different releases" in error["message"]
    prefill.wait_until(lambda: prefill.counter("phasefleet_kv_leases") == 0, 15)
