"""The pod network: every pod gets an address of its own on this machine.

Pod IPs cannot be on loopback (127.0.0.0/8): the API server refuses loopback addresses in
EndpointSlices, and the router finds workers through those. So pods take addresses from
198.18.0.0/15, the range set aside for benchmarking (RFC 2544, never routed on real networks),
made local to this machine by one route, as Linux does for 127.0.0.0/8:

    ip route add local 198.18.0.0/15 dev lo table local

`ensure_local_route` adds it when it is missing (this needs root; the route stays until removed
with `ip route del local 198.18.0.0/15 dev lo table local`). Each control plane claims one /20
of the range (`claim_block`), so clusters that run at once never hand out the same address.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import subprocess
import tempfile
from pathlib import Path

POD_RANGE = ipaddress.IPv4Network("198.18.0.0/15")
BLOCK_PREFIX = 20  # one cluster's pod CIDR: 4094 addresses
CLAIMS_DIR = Path(tempfile.gettempdir()) / "phasefleet-pod-cidrs"


def is_local(address: str) -> bool:
    """Whether a socket can listen on this address here."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                return False
            raise
    return True


def ensure_local_route() -> str | None:
    """Makes POD_RANGE local if it is not; returns why it could not, or None."""
    if is_local(str(POD_RANGE.network_address + 1)):
        return None
    command = ["ip", "route", "add", "local", str(POD_RANGE), "dev", "lo", "table", "local"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=10)
    except FileNotFoundError:
        return "no `ip` command (iproute2) to add the pod network's route"
    if result.returncode != 0:
        return f"`{' '.join(command)}` failed: {result.stderr.strip()} (it needs root)"
    return None


def not_local_message(address: str) -> str:
    return (
        f"pod IP {address} is not an address of this machine; as root run "
        f"`ip route add local {POD_RANGE} dev lo table local`"
    )


def claim_block(workdir: Path) -> ipaddress.IPv4Network:
    """A /20 of POD_RANGE no other live control plane holds. A claim is a file naming the
    claimer's work directory; it lapses when that directory is gone."""
    CLAIMS_DIR.mkdir(parents=True, exist_ok=True)
    blocks: list[ipaddress.IPv4Network] = list(POD_RANGE.subnets(new_prefix=BLOCK_PREFIX))
    start = int.from_bytes(os.urandom(2), "big") % len(blocks)
    for i in range(len(blocks)):
        block = blocks[(start + i) % len(blocks)]
        claim = CLAIMS_DIR / str(block.network_address)
        if claim.exists():
            holder = Path(claim.read_text().strip() or "/nonexistent")
            if holder.exists() and holder != workdir:
                continue
            claim.unlink(missing_ok=True)
        try:
            with claim.open("x") as f:
                f.write(str(workdir))
        except FileExistsError:
            continue
        return block
    raise RuntimeError(f"every /{BLOCK_PREFIX} of {POD_RANGE} is claimed (see {CLAIMS_DIR})")


def release_block(workdir: Path) -> None:
    if not CLAIMS_DIR.exists():
        return
    for claim in CLAIMS_DIR.iterdir():
        try:
            if claim.read_text().strip() == str(workdir):
                claim.unlink(missing_ok=True)
        except FileNotFoundError:
            continue
