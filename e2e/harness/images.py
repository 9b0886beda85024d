"""Which images the pod runner can "pull". Every image is the local phasefleet (the venv's
Python runs the pod's command), except one from a registry under `.invalid`, the top-level
domain RFC 2606 reserves so that it never resolves: pulling it fails as it would on any real
node, with the container runtime's words, ErrImagePull and then ImagePullBackOff."""

from __future__ import annotations

UNPULLABLE_DOMAIN = ".invalid"


def registry(image: str) -> str:
    """The registry host of an image reference (Docker Hub's when it names none)."""
    first, sep, _ = image.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


def pull_error(image: str) -> str | None:
    """Why `image` cannot be pulled, as containerd says it, or None when it can."""
    host = registry(image).split(":", 1)[0]
    if not host.endswith(UNPULLABLE_DOMAIN):
        return None
    return (
        f'failed to pull and unpack image "{image}": failed to resolve reference "{image}":'
        f" dial tcp: lookup {host}: no such host"
    )


def back_off_message(image: str, error: str) -> str:
    """The kubelet's ImagePullBackOff message, with the last pull's error."""
    return f'Back-off pulling image "{image}": ErrImagePull: {error}'
