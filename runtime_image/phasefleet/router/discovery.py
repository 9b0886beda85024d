"""Where a pool's workers are: each source answers `endpoints()` with the current list.

The pool calls `endpoints()` on every refresh (about once a second) and diffs the answer
against what it knows. An endpoint with `ready=False` is terminating: it gets no new requests but
finishes the ones it has. A worker missing from the answer is gone.

- `StaticDiscovery`: a fixed list of URLs (`--workers`, the local fleet).
- `FileDiscovery`: one pool of a JSON file `{pool: [url, ...]}` that a local fleet rewrites as
  workers start and drain (`--workers-file`, `phasefleet serve`).
- `DnsDiscovery`: the A records of a headless Service (`--worker-service host:port`); cluster
  DNS lists the ready pods only, so terminating ones simply disappear.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class Endpoint:
    url: str  # base URL, e.g. http://10.0.0.5:8000
    ready: bool = True  # False: terminating; no new requests, in-flight ones finish


class Discovery(Protocol):
    def describe(self) -> str:
        """What the source watches, for messages (e.g. `llm-worker.ns.svc:8000`)."""
        ...

    async def endpoints(self) -> list[Endpoint]: ...

    async def aclose(self) -> None:
        """Releases what the source holds (connections); called once at shutdown."""
        ...


def parse_host_port(address: str) -> tuple[str, int]:
    """`host:port` -> (host, port); ValueError naming the address otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


def normalize_url(url: str) -> str:
    """`127.0.0.1:8001` or `http://127.0.0.1:8001/` -> `http://127.0.0.1:8001`."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    scheme, _, rest = url.partition("://")
    if scheme not in ("http", "https") or not rest:
        raise ValueError(f"expected a worker URL like http://host:port, got {url!r}")
    return url


class StaticDiscovery:
    def __init__(self, urls: list[str]) -> None:
        if not urls:
            raise ValueError("the static worker list is empty")
        self.urls = list(dict.fromkeys(normalize_url(u) for u in urls))

    def describe(self) -> str:
        return ",".join(self.urls)

    async def endpoints(self) -> list[Endpoint]:
        return [Endpoint(url) for url in self.urls]

    async def aclose(self) -> None:
        pass


class FileDiscovery:
    """One pool's URLs from a JSON file {pool: [url, ...]}, read on every refresh (the writer
    replaces it atomically). A worker dropped from the file is gone: it finishes what it has."""

    def __init__(self, path: str | Path, pool: str) -> None:
        self.path = Path(path)
        self.pool = pool

    def describe(self) -> str:
        return f"{self.path}[{self.pool}]"

    async def endpoints(self) -> list[Endpoint]:
        urls = read_members(self.path).get(self.pool, [])
        return [Endpoint(normalize_url(u)) for u in urls]

    async def aclose(self) -> None:
        pass


def read_members(path: Path) -> dict[str, list[str]]:
    """The pools of a workers file; ValueError naming the file when it is not {pool: [url]}."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the workers file {path}: {exc}") from None
    if not isinstance(data, dict) or not all(
        isinstance(v, list) and all(isinstance(u, str) for u in v) for v in data.values()
    ):
        raise ValueError(f"the workers file {path} must hold {{pool: [url, ...]}}")
    return data


class DnsDiscovery:
    """Resolves a headless Service's name on every refresh; each address is one ready pod."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.host, self.port = parse_host_port(address)

    def describe(self) -> str:
        return self.address

    async def endpoints(self) -> list[Endpoint]:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            return []  # a headless Service without ready pods has no records
        urls = []
        for family, *_, sockaddr in infos:
            ip = str(sockaddr[0])
            host = f"[{ip}]" if family == socket.AF_INET6 else ip
            urls.append(f"http://{host}:{self.port}")
        return [Endpoint(url) for url in dict.fromkeys(urls)]

    async def aclose(self) -> None:
        pass
