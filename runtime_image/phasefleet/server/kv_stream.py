"""The decode side of the streamed KV hand-off: one POST whose answer is read off a raw socket,
frame by frame (kv_wire), with each KV payload received straight into its own buffer.

A general HTTP client parses the body in Python and copies each chunk it hands back (httpx
reached 0.34 of a loopback socket's bandwidth, `recv_into` 0.77), so the chunked body is
decoded here: the chunk-size lines and frame headers go through a small spill buffer, and a
payload's bytes go from the kernel into `StreamChunk.payload` with `recv_into`, copied only when a
small read for a chunk-size line took some of them along. Blocking: run it in a thread.

Before the start frame every failure raises `StreamError` (the caller prefills locally); after
it, the stream's failure is returned with the KV received so far (the caller recomputes the
rest; before the first token, the first token too), with the reason of a failure before the
first token (prefill_unreachable, prefill_refused) or after it (pull_*).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple
from urllib.parse import urlsplit

from phasefleet.server.kv_wire import (
    HEADER_LENGTH,
    MAX_HEADER_BYTES,
    MEDIA_TYPE,
    EndFrame,
    ErrorFrame,
    FirstFrame,
    KVFrame,
    StartFrame,
    decode_header,
)

HEADER_LIMIT = 64 * 1024  # bytes of status line and headers a prefill worker may send
LINE_LIMIT = 4096  # bytes of one chunk-size line
CONTROL_RECV = 4096  # bytes asked for when reading headers and chunk-size lines
ERROR_TEXT = 1024  # bytes of a refusal's body kept in its detail


class StreamReason(StrEnum):
    """Why a stream failed; the values are kv_transfer_failures labels."""

    PREFILL_UNREACHABLE = "prefill_unreachable"  # no connection, or it broke before the first
    PREFILL_REFUSED = "prefill_refused"  # a non-200, or a bad stream before the first token
    PULL_FAILED = "pull_failed"  # after the first: closed, reset, malformed or an ErrorFrame
    PULL_TIMEOUT = "pull_timeout"  # after the first: no byte for stall_timeout seconds
    PULL_ORDER = "pull_order"  # after the first: a block twice, out of order, past the end


class StreamError(Exception):
    """The stream failed before its first token; nothing it sent is usable."""

    def __init__(self, reason: StreamReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class StreamFailure(NamedTuple):
    reason: StreamReason  # a PULL_* reason; before the first token a PREFILL_* one
    detail: str


@dataclass
class StreamChunk:
    first_block: int  # the prompt's block the payload starts at
    num_blocks: int
    payload: bytearray  # layer-major, as kv_wire.KVFrame describes


@dataclass
class StreamedPrefill:
    """What one stream delivered. The KV itself went to `on_chunk` frame by frame (nothing
    here keeps it); with a `failure`, the frames that arrived whole were handed on."""

    start: StartFrame | None = None
    first: FirstFrame | None = None  # None only with a failure before the first token
    num_blocks: int = 0  # blocks handed on, contiguous from start.skip_blocks
    nbytes: int = 0  # their payload bytes
    end: EndFrame | None = None  # None when the stream failed
    failure: StreamFailure | None = None

    @property
    def next_block(self) -> int:
        """The first block that did not arrive (start.num_blocks when all did)."""
        skip = 0 if self.start is None else self.start.skip_blocks
        return skip + self.num_blocks


class _Stop(Exception):
    """A failure while reading; `transport` when the connection (not the sender) is at fault."""

    def __init__(self, reason: StreamReason, detail: str, transport: bool = False) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail
        self.transport = transport


def _malformed(detail: str) -> _Stop:
    return _Stop(StreamReason.PULL_FAILED, detail)


class _Body:
    """One response on a socket: its head, then its body with the chunked framing taken off."""

    def __init__(self, sock: socket.socket, deadline: float, stall: float) -> None:
        self.sock = sock
        self.deadline: float | None = deadline  # monotonic; None: `stall` between any two reads
        self.stall = stall
        self.spill = bytearray()  # received but not consumed yet
        self.chunked = True
        self.left = 0  # body bytes left in the current HTTP chunk
        self.crlf_due = False  # the current chunk's data ended; its CRLF is not read yet
        self.done = False  # the body's end was reached

    def arm(self) -> None:
        if self.deadline is None:
            if self.sock.gettimeout() != self.stall:
                self.sock.settimeout(self.stall)
            return
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        self.sock.settimeout(left)

    def _recv_control(self) -> None:
        self.arm()
        data = self.sock.recv(CONTROL_RECV)
        if not data:
            raise _Stop(StreamReason.PULL_FAILED, "the connection closed", transport=True)
        self.spill += data

    def _line(self) -> bytes:
        while (end := self.spill.find(b"\r\n")) < 0:
            if len(self.spill) > LINE_LIMIT:
                raise _malformed(f"a chunk-size line over {LINE_LIMIT} bytes")
            self._recv_control()
        line = bytes(self.spill[:end])
        del self.spill[: end + 2]
        return line

    def head(self) -> tuple[int, dict[str, str]]:
        """The status code and the headers (names in lower case); sets up the body's framing."""
        while (end := self.spill.find(b"\r\n\r\n")) < 0:
            if len(self.spill) > HEADER_LIMIT:
                raise _malformed(f"headers over {HEADER_LIMIT} bytes")
            self._recv_control()
        lines = self.spill[:end].decode("latin-1").split("\r\n")
        del self.spill[: end + 4]
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
            raise _malformed(f"not an HTTP status line: {lines[0][:80]!r}")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = headers.get("content-length", "")
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.chunked = True
        else:  # a Content-Length, or else the body ends when the connection closes
            self.chunked = False
            self.left = int(length) if length.isdigit() else 1 << 62
            self.done = self.left == 0
        return int(parts[1]), headers

    def _open(self) -> bool:
        """Makes an HTTP chunk with bytes left current; False at the body's end."""
        while self.left == 0 and not self.done:
            if not self.chunked:
                self.done = True
                break
            if self.crlf_due and self._line() != b"":
                raise _malformed("an HTTP chunk longer than its size")
            size = self._line().split(b";")[0].strip()
            try:
                self.left = int(size, 16)
            except ValueError:
                raise _malformed(f"a bad chunk-size line: {size[:40]!r}") from None
            self.crlf_due = True
            self.done = self.left == 0  # the trailers, if any, are left unread
        return not self.done

    def read_into(self, view: memoryview) -> None:
        """Fills `view` with the body's next bytes: from the spill first, then recv_into."""
        pos = 0
        while pos < len(view):
            if not self._open():
                raise _Stop(StreamReason.PULL_FAILED, "the body ended mid-frame", transport=True)
            want = min(self.left, len(view) - pos)
            if self.spill:
                n = min(want, len(self.spill))
                with memoryview(self.spill) as spill:
                    view[pos : pos + n] = spill[:n]
                del self.spill[:n]
            else:
                self.arm()
                n = self.sock.recv_into(view[pos : pos + want])
                if n == 0:
                    raise _Stop(StreamReason.PULL_FAILED, "the connection closed", transport=True)
            pos += n
            self.left -= n

    def read(self, n: int) -> bytearray:
        data = bytearray(n)
        self.read_into(memoryview(data))
        return data

    def text(self) -> str:
        """Up to ERROR_TEXT bytes of what is left of the body, as far as it can be read."""
        data = bytearray()
        try:
            while len(data) < ERROR_TEXT and self._open():
                if not self.spill:
                    self._recv_control()
                n = min(self.left, len(self.spill), ERROR_TEXT - len(data))
                data += self.spill[:n]
                del self.spill[:n]
                self.left -= n
        except (_Stop, OSError):
            pass
        return data.decode("utf-8", "replace")


def _frame(body: _Body) -> StartFrame | KVFrame | FirstFrame | EndFrame | ErrorFrame:
    (length,) = HEADER_LENGTH.unpack(body.read(HEADER_LENGTH.size))
    if length > MAX_HEADER_BYTES:
        raise _malformed(f"a frame header of {length} bytes (at most {MAX_HEADER_BYTES})")
    try:
        return decode_header(bytes(body.read(length)))
    except ValueError as exc:
        raise _malformed(str(exc)) from None


def _failed(frame: ErrorFrame) -> _Stop:
    return _malformed(f"the prefill worker failed: {frame.reason}: {frame.detail}")


def _check_kv(frame: KVFrame, start: StartFrame, next_block: int, block_bytes: int) -> None:
    last = frame.first_block + frame.num_blocks
    if frame.first_block < next_block:
        why = f"blocks {frame.first_block}..{last - 1} again (next is {next_block})"
    elif frame.first_block > next_block:
        why = f"block {frame.first_block} out of order (next is {next_block})"
    elif last > start.num_blocks:
        why = f"blocks up to {last - 1} of a prompt of {start.num_blocks}"
    elif frame.nbytes != frame.num_blocks * block_bytes:
        why = f"{frame.nbytes} bytes for {frame.num_blocks} blocks of {block_bytes}"
    else:
        return
    raise _Stop(StreamReason.PULL_ORDER, why)


def _read(
    body: _Body,
    result: StreamedPrefill,
    on_start: Callable[[StartFrame], None],
    on_first: Callable[[StartFrame, FirstFrame], None],
    on_chunk: Callable[[StreamChunk], None],
) -> None:
    status, headers = body.head()
    if status != 200:
        raise _malformed(f"status {status}: {body.text()}")
    kind = headers.get("content-type", "")
    if not kind.startswith(MEDIA_TYPE):
        raise _malformed(f"content-type {kind!r}, not {MEDIA_TYPE}")
    start = _frame(body)
    if isinstance(start, ErrorFrame):
        raise _failed(start)
    if not isinstance(start, StartFrame):
        raise _malformed(f"the stream began with {start!r}, not a start frame")
    if start.skip_blocks > start.num_blocks:
        raise _malformed(f"skip_blocks {start.skip_blocks} of {start.num_blocks} blocks")
    result.start = start
    on_start(start)
    block_bytes = start.layout.layout().block_bytes()
    next_block = start.skip_blocks
    while True:
        frame = _frame(body)
        if isinstance(frame, KVFrame):
            _check_kv(frame, start, next_block, block_bytes)
            payload = bytearray(frame.nbytes)
            body.read_into(memoryview(payload))
            on_chunk(StreamChunk(frame.first_block, frame.num_blocks, payload))
            result.num_blocks += frame.num_blocks
            result.nbytes += frame.nbytes
            next_block += frame.num_blocks
        elif isinstance(frame, FirstFrame):
            if result.first is not None:
                raise _malformed("a second first frame")
            result.first = frame
            body.deadline = None
            on_first(start, frame)
        elif isinstance(frame, EndFrame):
            sent = next_block - start.skip_blocks
            if result.first is None:
                raise _malformed("the stream ended before its first token")
            if frame.num_blocks != sent:
                raise _Stop(StreamReason.PULL_ORDER, f"end counts {frame.num_blocks}, got {sent}")
            if result.first.finish_reason == "handoff" and next_block != start.num_blocks:
                why = f"ended at block {next_block} of {start.num_blocks}"
                raise _Stop(StreamReason.PULL_ORDER, why)
            result.end = frame
            return
        elif isinstance(frame, ErrorFrame):
            raise _failed(frame)
        else:
            raise _malformed("a second start frame")


def stream_prefill(
    url: str,
    headers: dict[str, str],
    body: bytes,
    on_start: Callable[[StartFrame], None],
    on_first: Callable[[StartFrame, FirstFrame], None],
    on_chunk: Callable[[StreamChunk], None],
    connect_timeout: float,
    first_timeout: float,
    stall_timeout: float,
) -> StreamedPrefill:
    """POSTs `body` (a kv_wire.PrefillRequest's JSON) to `url` (http only) and reads the stream.

    In this thread: `on_start(start)` once the prefill worker has taken the prompt;
    `on_first(start, first)` as soon as the first token arrives, while the rest of the KV is
    still to come; `on_chunk` as soon as each KV frame has arrived whole. Seconds:
    `connect_timeout` to connect; `first_timeout` from then until the first token (the prefill
    may queue); `stall_timeout` between any two reads after it. StreamError before the start
    frame; after it, `failure` says what broke."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise StreamError(StreamReason.PREFILL_UNREACHABLE, f"expected an http:// URL: {url!r}")
    host, port = parts.hostname, parts.port or 80
    lines = [f"POST {parts.path or '/'} HTTP/1.1", f"Host: {host}:{port}", "Connection: close"]
    lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout)
    except OSError as exc:
        raise StreamError(StreamReason.PREFILL_UNREACHABLE, f"{host}:{port}: {exc!r}") from None
    result = StreamedPrefill()
    stop: _Stop | None = None
    with sock:
        try:
            reader = _Body(sock, time.monotonic() + first_timeout, stall_timeout)
            reader.arm()
            sock.sendall(request)
            _read(reader, result, on_start, on_first, on_chunk)
        except _Stop as exc:
            stop = exc
        except TimeoutError:
            late = result.first is not None
            why = f"no byte for {stall_timeout}s" if late else f"no first token in {first_timeout}s"
            stop = _Stop(StreamReason.PULL_TIMEOUT, why, transport=True)
        except OSError as exc:
            stop = _Stop(StreamReason.PULL_FAILED, repr(exc), transport=True)
    if stop is None:
        return result
    reason = stop.reason
    if result.first is None:
        early = StreamReason.PREFILL_UNREACHABLE, StreamReason.PREFILL_REFUSED
        reason = early[0] if stop.transport else early[1]
        if result.start is None:
            raise StreamError(reason, stop.detail)
    result.failure = StreamFailure(reason, stop.detail)
    return result
