"""The streamed hand-off's reader against a scripted localhost responder: payloads arrive whole
through any HTTP chunking, the first token is handed over while KV still arrives, and every bad
stream is a StreamError (before the first token) or a returned failure (after it)."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from phasefleet.engine.sampling_params import Grammar
from phasefleet.server.kv_stream import (
    StreamChunk,
    StreamedPrefill,
    StreamError,
    StreamReason,
    stream_prefill,
)
from phasefleet.server.kv_wire import (
    HEADER_LENGTH,
    MEDIA_TYPE,
    PREFILL_PATH,
    EndFrame,
    ErrorFrame,
    FirstFrame,
    KVFrame,
    LayoutWire,
    StartFrame,
    encode_header,
)

SMALL = LayoutWire(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype="float16")
BIG = LayoutWire(num_layers=4, num_kv_heads=8, head_dim=64, block_size=16, dtype="float16")
FIRST = FirstFrame(first_token_id=7, finish_reason="handoff", num_cached_tokens=0)

Handler = Callable[[socket.socket], None]


@dataclass
class Responder:
    url: str  # where to POST the prefill
    handlers: list[Handler] = field(default_factory=list)  # one per connection, in order
    requests: list[bytes] = field(default_factory=list)  # each connection's request as read
    done: threading.Event = field(default_factory=threading.Event)  # released at teardown


@pytest.fixture
def responder() -> Iterator[Responder]:
    server = socket.create_server(("127.0.0.1", 0))
    found = Responder(f"http://127.0.0.1:{server.getsockname()[1]}{PREFILL_PATH}")

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(4096)
                head, _, body = request.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                while len(body) < length:
                    body += conn.recv(4096)
                found.requests.append(request)
                with contextlib.suppress(OSError):  # the reader hung up first
                    found.handlers.pop(0)(conn)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield found
    finally:
        found.done.set()
        server.close()


def payload(layout: LayoutWire, num_blocks: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(num_blocks * layout.layout().block_bytes())


def kv(first_block: int, data: bytes, layout: LayoutWire = SMALL) -> bytes:
    """A KV frame carrying `data` (whole blocks of `layout`) from `first_block` on."""
    num_blocks = len(data) // layout.layout().block_bytes()
    frame = KVFrame(first_block=first_block, num_blocks=num_blocks, nbytes=len(data))
    return encode_header(frame) + data


def start(num_blocks: int, skip_blocks: int = 0, layout: LayoutWire = SMALL) -> bytes:
    return encode_header(
        StartFrame(
            layout=layout,
            num_prompt_tokens=num_blocks * layout.block_size,
            num_blocks=num_blocks,
            skip_blocks=skip_blocks,
        )
    )


def end(num_blocks: int) -> bytes:
    return encode_header(EndFrame(num_blocks=num_blocks))


def chunked(data: bytes, size: int | None = None, last: bool = True) -> bytes:
    """`data` as HTTP chunks of `size` bytes (one chunk when None), then the last chunk."""
    step = size or max(len(data), 1)
    pieces = [data[i : i + step] for i in range(0, len(data), step)]
    out = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces)
    return out + (b"0\r\n\r\n" if last else b"")


def ok_head(extra: str = "transfer-encoding: chunked") -> bytes:
    return f"HTTP/1.1 200 OK\r\ncontent-type: {MEDIA_TYPE}\r\n{extra}\r\n\r\n".encode()


def send(*parts: bytes) -> Handler:
    return lambda conn: conn.sendall(b"".join(parts))


def pull(
    responder: Responder, **kwargs: float
) -> tuple[StreamedPrefill, list[FirstFrame], list[StreamChunk]]:
    """The result, the first frames and the KV chunks handed on (in the order they came)."""
    firsts: list[FirstFrame] = []
    handed: list[StreamChunk] = []
    starts: list[StartFrame] = []
    timeouts = {"connect_timeout": 5.0, "first_timeout": 10.0, "stall_timeout": 10.0} | kwargs
    result = stream_prefill(
        responder.url,
        {"X-PhaseFleet-Internal-Token": "t"},
        b'{"request_id": "r-0"}',
        starts.append,
        lambda start, first: firsts.append(first) if starts == [start] else None,
        handed.append,
        **timeouts,
    )
    assert starts == [result.start]  # told once, before anything else
    assert result.num_blocks == sum(c.num_blocks for c in handed)
    assert result.nbytes == sum(len(c.payload) for c in handed)
    return result, firsts, handed


A = payload(SMALL, 2, seed=1)  # blocks 0-1
B = payload(SMALL, 1, seed=2)  # block 2
C = payload(SMALL, 3, seed=3)  # blocks 3-5
WHOLE = start(6) + kv(0, A) + kv(2, B) + encode_header(FIRST) + kv(3, C) + end(6)


@pytest.mark.parametrize(
    "answer",
    [
        ok_head() + chunked(WHOLE, 1),
        ok_head() + chunked(WHOLE, 7),  # splits lengths, headers and payloads
        ok_head() + chunked(WHOLE),
        ok_head(f"content-length: {len(WHOLE)}") + WHOLE,
        ok_head("connection: close") + WHOLE,  # the body ends with the connection
    ],
    ids=["1-byte-chunks", "7-byte-chunks", "one-chunk", "content-length", "close-delimited"],
)
def test_payloads_arrive_exactly_through_any_chunking(responder: Responder, answer: bytes) -> None:
    responder.handlers.append(send(answer))
    result, firsts, chunks = pull(responder)
    assert result.failure is None
    assert firsts == [FIRST] and result.first == FIRST
    assert [(c.first_block, c.num_blocks, bytes(c.payload)) for c in chunks] == [
        (0, 2, A),
        (2, 1, B),
        (3, 3, C),
    ]
    assert result.end == EndFrame(num_blocks=6) and result.next_block == 6
    request = responder.requests[0]
    assert request.startswith(f"POST {PREFILL_PATH} HTTP/1.1\r\n".encode())
    assert b"X-PhaseFleet-Internal-Token: t\r\n" in request
    assert request.endswith(b'\r\n\r\n{"request_id": "r-0"}')


@pytest.mark.parametrize("size", [None, 65536 + 3], ids=["one-chunk", "odd-chunks"])
def test_megabytes_of_payload_arrive_exactly(responder: Responder, size: int | None) -> None:
    blocks = payload(BIG, 16, seed=4)  # 2 MiB
    stream = start(24, layout=BIG) + encode_header(FIRST)
    stream += kv(0, blocks, BIG) + kv(16, blocks[: len(blocks) // 2], BIG) + end(24)
    responder.handlers.append(send(ok_head() + chunked(stream, size)))
    result, _, chunks = pull(responder)
    assert result.failure is None and result.next_block == 24
    assert bytes(chunks[0].payload) == blocks
    assert bytes(chunks[1].payload) == blocks[: len(blocks) // 2]


def test_a_float8_layout_streams_one_byte_a_value(responder: Responder) -> None:
    """A `--kv-cache-dtype fp8` prefill worker's layout: the start frame names float8_e4m3fn
    and its blocks are half a float16 layout's bytes."""
    fp8 = SMALL.model_copy(update={"dtype": "float8_e4m3fn"})
    assert 2 * fp8.layout().block_bytes() == SMALL.layout().block_bytes()
    blocks = payload(fp8, 3, seed=5)
    stream = start(3, layout=fp8) + encode_header(FIRST) + kv(0, blocks, fp8) + end(3)
    responder.handlers.append(send(ok_head() + chunked(stream)))
    result, _, chunks = pull(responder)
    assert result.failure is None and result.start is not None
    assert result.start.layout.layout() == fp8.layout()
    assert bytes(chunks[0].payload) == blocks


def test_the_first_token_is_handed_over_while_kv_still_arrives(responder: Responder) -> None:
    handed_over = threading.Event()
    waited: list[bool] = []

    def respond(conn: socket.socket) -> None:
        conn.sendall(ok_head() + chunked(start(6) + kv(0, A) + encode_header(FIRST), last=False))
        waited.append(handed_over.wait(10))  # the rest is sent only once on_first has run
        conn.sendall(chunked(kv(2, B) + kv(3, C) + end(6)))

    responder.handlers.append(respond)
    chunks: list[StreamChunk] = []
    result = stream_prefill(
        responder.url, {}, b"{}", print, lambda *_: handed_over.set(), chunks.append, 5, 10, 10
    )
    assert waited == [True]
    assert result.failure is None and [c.first_block for c in chunks] == [0, 2, 3]


def test_skipped_blocks_are_not_expected(responder: Responder) -> None:
    stream = start(6, skip_blocks=3) + encode_header(FIRST) + kv(3, C) + end(3)
    responder.handlers.append(send(ok_head() + chunked(stream, 5)))
    result, _, chunks = pull(responder)
    assert result.failure is None and result.start is not None and result.start.skip_blocks == 3
    assert [(c.first_block, bytes(c.payload)) for c in chunks] == [(3, C)]
    assert result.next_block == 6


REFUSAL = b'{"error": {"message": "the prefill queue is full", "type": "overloaded"}}'


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        (
            b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            + b"content-length: %d\r\n\r\n" % len(REFUSAL)
            + REFUSAL,
            "status 503: " + REFUSAL.decode(),
        ),
        (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
            "not application/x-phasefleet-kv-stream",
        ),
        (ok_head() + chunked(kv(0, A) + encode_header(FIRST)), "not a start frame"),
        (ok_head() + chunked(b"\x02\x00\x00\x00{}"), "a malformed frame header"),
        (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP status line"),
    ],
    ids=["503", "json-200", "kv-before-start", "bad-header", "not-http"],
)
def test_a_bad_answer_before_the_start_is_refused(
    responder: Responder, answer: bytes, words: str
) -> None:
    responder.handlers.append(send(answer))
    with pytest.raises(StreamError) as caught:
        pull(responder)
    assert caught.value.reason == StreamReason.PREFILL_REFUSED == "prefill_refused"
    assert words in caught.value.detail


@pytest.mark.parametrize(
    ("after", "words"),
    [
        (
            encode_header(ErrorFrame(reason="oom", detail="no blocks")),
            "the prefill worker failed: oom: no blocks",
        ),
        (kv(3, C), "out of order"),
        (end(2), "ended before its first token"),
    ],
    ids=["error-frame", "out-of-order", "end-first"],
)
def test_a_bad_answer_after_the_start_keeps_what_arrived_without_a_first_token(
    responder: Responder, after: bytes, words: str
) -> None:
    responder.handlers.append(send(ok_head() + chunked(start(6) + kv(0, A) + after)))
    result, firsts, chunks = pull(responder)
    assert result.failure is not None and result.failure.reason == StreamReason.PREFILL_REFUSED
    assert words in result.failure.detail
    assert firsts == [] and result.first is None and result.end is None
    assert [(c.first_block, bytes(c.payload)) for c in chunks] == [(0, A)]


def test_nobody_listening_is_unreachable() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    with pytest.raises(StreamError) as caught:
        stream_prefill(f"http://127.0.0.1:{port}/", {}, b"{}", print, print, print, 5, 5, 5)
    assert caught.value.reason == StreamReason.PREFILL_UNREACHABLE


def test_a_connection_lost_before_the_start_is_unreachable(responder: Responder) -> None:
    responder.handlers.append(send(b""))
    with pytest.raises(StreamError) as caught:
        pull(responder)
    assert caught.value.reason == StreamReason.PREFILL_UNREACHABLE


def test_a_connection_lost_before_the_first_token_is_unreachable_and_keeps_what_arrived(
    responder: Responder,
) -> None:
    responder.handlers.append(send(ok_head() + chunked(start(6) + kv(0, A), last=False)))
    result, firsts, chunks = pull(responder)
    assert result.failure is not None
    assert result.failure.reason == StreamReason.PREFILL_UNREACHABLE and firsts == []
    assert [(c.first_block, bytes(c.payload)) for c in chunks] == [(0, A)]


def test_no_first_token_in_time_is_unreachable(responder: Responder) -> None:
    def respond(conn: socket.socket) -> None:
        conn.sendall(ok_head())
        responder.done.wait(10)

    responder.handlers.append(respond)
    with pytest.raises(StreamError) as caught:
        pull(responder, first_timeout=0.2)
    assert caught.value.reason == StreamReason.PREFILL_UNREACHABLE
    assert "no first token in 0.2s" in caught.value.detail


BEFORE = start(6) + kv(0, A) + encode_header(FIRST)  # then blocks 2.. are due


@pytest.mark.parametrize(
    ("after", "reason", "words", "kept"),
    [
        (kv(2, B)[:-3], StreamReason.PULL_FAILED, "connection closed", 1),  # cut mid-payload
        (kv(2, B), StreamReason.PULL_FAILED, "connection closed", 2),  # cut between frames
        (
            encode_header(ErrorFrame(reason="pull_failed", detail="engine died")),
            StreamReason.PULL_FAILED,
            "engine died",
            1,
        ),
        (b"\x05\x00\x00\x00{nope", StreamReason.PULL_FAILED, "malformed frame header", 1),
        (kv(3, C), StreamReason.PULL_ORDER, "block 3 out of order (next is 2)", 1),
        (kv(2, B) + kv(2, B), StreamReason.PULL_ORDER, "blocks 2..2 again (next is 3)", 2),
        (kv(2, B) + kv(3, C + B), StreamReason.PULL_ORDER, "blocks up to 6 of a prompt of 6", 2),
        (
            encode_header(KVFrame(first_block=2, num_blocks=1, nbytes=len(B) + 1)) + B + b"x",
            StreamReason.PULL_ORDER,
            f"{len(B) + 1} bytes for 1 blocks of {len(B)}",
            1,
        ),
        (kv(2, B) + kv(3, C) + end(5), StreamReason.PULL_ORDER, "end counts 5, got 6", 3),
        (kv(2, B) + end(3), StreamReason.PULL_ORDER, "ended at block 3 of 6", 2),
        (encode_header(FIRST), StreamReason.PULL_FAILED, "a second first frame", 1),
    ],
    ids=[
        "cut-mid-payload",
        "cut-between-frames",
        "error-frame",
        "bad-header",
        "out-of-order",
        "duplicate",
        "past-the-end",
        "wrong-nbytes",
        "end-count",
        "end-early",
        "second-first",
    ],
)
def test_a_failure_after_the_first_token_keeps_what_arrived(
    responder: Responder, after: bytes, reason: StreamReason, words: str, kept: int
) -> None:
    responder.handlers.append(send(ok_head() + chunked(BEFORE + after, 9, last=False)))
    result, firsts, chunks = pull(responder)
    assert result.failure is not None
    assert result.failure.reason == reason and words in result.failure.detail
    assert firsts == [FIRST] and result.end is None
    received = [(c.first_block, bytes(c.payload)) for c in chunks]
    assert received == [(0, A), (2, B), (3, C)][:kept]  # the frames before the bad one


def test_a_stalled_stream_times_out_and_hangs_up(responder: Responder) -> None:
    heard: list[bytes] = []
    hung_up = threading.Event()

    def respond(conn: socket.socket) -> None:
        conn.sendall(ok_head() + chunked(BEFORE + kv(2, B)[:-3], last=False))
        conn.settimeout(10)
        heard.append(conn.recv(1))  # b"" once the reader has closed its socket
        hung_up.set()

    responder.handlers.append(respond)
    result, _, chunks = pull(responder, stall_timeout=0.2)
    assert result.failure is not None and result.failure.reason == StreamReason.PULL_TIMEOUT
    assert result.failure.detail == "no byte for 0.2s"
    assert [c.first_block for c in chunks] == [0]
    assert hung_up.wait(5) and heard == [b""]


def test_the_ttft_target_crosses_the_hand_off_and_a_bad_one_is_ignored_or_refused() -> None:
    """The router's header becomes a request's target only when it is a positive number (else
    the worker's own applies); the hand-off's request carries it on and refuses one <= 0."""
    from pydantic import ValidationError

    from phasefleet.api.contract import LATE_AFTER_HEADER
    from phasefleet.engine.sampling_params import SamplingParams
    from phasefleet.server.kv_wire import PrefillRequest
    from phasefleet.server.state import WorkerState

    given = {v: WorkerState.late_after_s({LATE_AFTER_HEADER: v}) for v in ("800", "0", "-5", "x")}
    assert given == {"800": 0.8, "0": None, "-5": None, "x": None}
    assert WorkerState.late_after_s({}) is None
    body = PrefillRequest.of("r", [1, 2], SamplingParams(max_tokens=2), late_after_s=0.8)
    assert PrefillRequest.model_validate_json(body.model_dump_json()).late_after_s == 0.8
    with pytest.raises(ValidationError, match="late_after_s"):
        PrefillRequest.model_validate({**body.model_dump(), "late_after_s": 0})


def newer(frame: bytes, **fields: object) -> bytes:
    """`frame` (a header without payload) as a peer of a later release sends it: more fields."""
    header = json.loads(frame[HEADER_LENGTH.size :]) | fields
    data = json.dumps(header).encode()
    return HEADER_LENGTH.pack(len(data)) + data


def test_a_newer_peers_unknown_fields_are_ignored_both_ways(responder: Responder) -> None:
    """The wire's version rule: fields added by a later release do not break this one."""
    from phasefleet.engine.sampling_params import SamplingParams
    from phasefleet.server.kv_wire import MIN_WIRE_VERSION, PrefillRequest

    stream = newer(start(6), compression="zstd") + kv(0, A) + kv(2, B)
    stream += newer(encode_header(FIRST), draft_token_ids=[4, 5]) + kv(3, C) + end(6)
    responder.handlers.append(send(ok_head() + chunked(stream)))
    result, firsts, chunks = pull(responder)
    assert result.failure is None and firsts == [FIRST]
    assert [bytes(c.payload) for c in chunks] == [A, B, C]

    sent = PrefillRequest.of("r", [1, 2], SamplingParams(max_tokens=2))
    assert sent.wire_version == MIN_WIRE_VERSION and '"wire_version":1' in sent.model_dump_json()
    later = PrefillRequest.model_validate({**sent.model_dump(), "deadline": "soon"})
    assert later == sent


@pytest.mark.parametrize(
    ("settings", "version"),
    [
        ({}, 1),
        ({"presence_penalty": 1.0, "frequency_penalty": -1.0}, 1),  # nothing to the first token
        ({"repetition_penalty": 1.2}, 2),
        ({"min_p": 0.1}, 2),
        ({"logit_bias": {5: -3.0}}, 2),
        ({"grammar": Grammar("regex", "[a-z]+")}, 3),
        ({"grammar": Grammar("json", '{"type": "object"}'), "min_p": 0.1}, 3),
        ({"grammar": Grammar("regex", "a|b", after=(151668,))}, 5),  # after the thought
        ({"allowed_token_ids": [3, 7]}, 6),
        ({"bad_words": [[5], [6, 7]], "logit_bias": {2: 1.0}}, 6),
    ],
)
def test_a_request_goes_in_the_lowest_wire_version_that_carries_it(
    settings: dict[str, Any], version: int
) -> None:
    """A prefill worker of version 1 would sample the first token without the bias, the
    repetition penalty or min-p: such a request asks for version 2 (refused by that worker:
    the decode worker prefills it itself), one with a grammar for version 3, one whose grammar
    starts after a thought for version 5, one with allowed tokens or bad words for version 6;
    any other stays answerable by every version."""
    from phasefleet.engine.sampling_params import SamplingParams
    from phasefleet.server.kv_wire import WIRE_VERSION, PrefillRequest

    params = SamplingParams(max_tokens=4, **settings)
    sent = PrefillRequest.of("r", [1, 2], params)
    assert sent.wire_version == version <= WIRE_VERSION
    received = PrefillRequest.model_validate_json(sent.model_dump_json())
    assert received.sampling() == params  # every field across, the bias's ids as integers


def test_a_request_with_a_lora_adapter_goes_in_version_4_and_names_it() -> None:
    """A prefill worker of version 3 would compute the prompt on the base model."""
    from phasefleet.engine.sampling_params import SamplingParams
    from phasefleet.server.kv_wire import LORA_WIRE_VERSION, WIRE_VERSION, PrefillRequest

    sent = PrefillRequest.of("r", [1, 2], SamplingParams(max_tokens=4), lora="sql")
    assert sent.wire_version == LORA_WIRE_VERSION == 4 <= WIRE_VERSION
    assert PrefillRequest.model_validate_json(sent.model_dump_json()).lora == "sql"
    assert PrefillRequest.of("r", [1, 2], SamplingParams(max_tokens=4)).lora is None
