"""The KV pull's socket reader against a plain local HTTP responder: the body lands in the
buffer, and every bad answer is a PullError with the failures metric's reason."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from phasefleet.server.kv_pull import PullError, get_into

BODY = bytes(range(256)) * 4096  # 1 MiB


@dataclass
class Responder:
    url: str  # where to pull from
    replies: list[bytes]  # the next connection gets the first, then the connection closes


@pytest.fixture
def responder() -> Iterator[Responder]:
    server = socket.create_server(("127.0.0.1", 0))
    found = Responder(f"http://127.0.0.1:{server.getsockname()[1]}/internal/kv/r-0", [])

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
                conn.sendall(found.replies.pop(0))

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield found
    finally:
        server.close()


def reply(status: str, body: bytes, length: int | None = None) -> bytes:
    size = len(body) if length is None else length
    return f"HTTP/1.1 {status}\r\ncontent-length: {size}\r\n\r\n".encode() + body


def test_the_body_lands_in_the_buffer(responder: Responder) -> None:
    responder.replies.append(reply("200 OK", BODY))
    buffer = bytearray(len(BODY))
    assert get_into(
        responder.url, {"X-PhaseFleet-Internal-Token": "t"}, memoryview(buffer), 10
    ) == len(BODY)
    assert bytes(buffer) == BODY


def test_a_sender_that_hangs_up_early_gives_a_short_count(responder: Responder) -> None:
    responder.replies.append(reply("200 OK", BODY[: len(BODY) // 2], length=len(BODY)))
    buffer = bytearray(len(BODY))
    assert get_into(responder.url, {}, memoryview(buffer), 10) == len(BODY) // 2


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (reply("404 Not Found", b"{}"), "lease_expired"),
        (reply("401 Unauthorized", b"{}"), "pull_failed"),
        (reply("200 OK", b"x" * 10), "pull_failed"),  # not the size the layout says
        (b"garbage\r\n\r\n", "pull_failed"),
    ],
)
def test_bad_answers_name_their_reason(responder: Responder, answer: bytes, reason: str) -> None:
    responder.replies.append(answer)
    with pytest.raises(PullError) as caught:
        get_into(responder.url, {}, memoryview(bytearray(len(BODY))), 10)
    assert caught.value.reason == reason


def test_nobody_listening_is_a_failed_pull() -> None:
    with pytest.raises(PullError) as caught:
        get_into("http://127.0.0.1:9/internal/kv/x", {}, memoryview(bytearray(8)), 5)
    assert caught.value.reason == "pull_failed"
