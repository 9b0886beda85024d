"""A real Prometheus server (Debian's binary) with a given scrape config, for e2e tests."""

from __future__ import annotations

import json
import shutil
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from e2e.harness.process import Component, free_port


@dataclass
class Prometheus:
    workdir: Path
    scrape_configs: list[dict[str, Any]]
    scrape_interval: str = "1s"
    port: int = field(default_factory=free_port)
    component: Component | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus not found: run e2e/tools/install-prometheus.sh")
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": self.scrape_interval, "evaluation_interval": "1s"},
            "scrape_configs": self.scrape_configs,
        }
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.component = Component(
            name="prometheus",
            argv=[
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
                "--log.level=warn",
            ],
            log_path=self.workdir / "prometheus.log",
        )
        self.component.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.component.check_alive()
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"prometheus not ready; log:\n{self.component.log_tail()}")

    def stop(self) -> None:
        if self.component is not None:
            self.component.stop()

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query; returns the result vector."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.loads(response.read())
        if body.get("status") != "success":
            raise RuntimeError(f"query {promql!r} failed: {body}")
        return list(body["data"]["result"])
