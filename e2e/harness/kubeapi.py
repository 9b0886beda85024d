"""A small JSON client for the Kubernetes API, authenticated the way the harness's kubeconfig
says (bearer token, cluster CA). The pod runner uses it; it needs no Kubernetes library."""

from __future__ import annotations

import base64
import json
import ssl
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"


class ApiError(RuntimeError):
    """An HTTP error answer; `status` is its code, the message the API server's `message`."""

    def __init__(self, method: str, path: str, status: int, message: str):
        super().__init__(f"{method} {path} answered {status}: {message}")
        self.status = status


@dataclass
class KubeApi:
    server: str  # https://host:port
    token: str
    ca_file: Path
    timeout: float = 10.0  # seconds per request

    @classmethod
    def from_kubeconfig(cls, path: Path) -> KubeApi:
        config = json.loads(path.read_text())
        cluster = config["clusters"][0]["cluster"]
        ca = base64.b64decode(cluster["certificate-authority-data"])
        ca_file = Path(tempfile.mkdtemp(prefix="kubeapi-")) / "ca.crt"
        ca_file.write_bytes(ca)
        return cls(cluster["server"], config["users"][0]["user"]["token"], ca_file)

    def __post_init__(self) -> None:
        self._context = ssl.create_default_context(cafile=str(self.ca_file))

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = "application/json",
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = content_type
        request = urllib.request.Request(
            f"{self.server}{path}", data=data, method=method, headers=headers
        )
        try:
            with urllib.request.urlopen(
                request, context=self._context, timeout=self.timeout
            ) as answer:
                return json.loads(answer.read() or b"null")
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            try:
                message = json.loads(text).get("message", text)
            except ValueError:
                message = text
            raise ApiError(method, path, exc.code, message) from None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def patch(self, path: str, body: Any, content_type: str = STRATEGIC_PATCH) -> Any:
        return self.request("PATCH", path, body, content_type)

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)

    def delete(self, path: str, body: Any = None) -> Any:
        return self.request("DELETE", path, body)
