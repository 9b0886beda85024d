"""A stand-in for `phasefleet worker` and `phasefleet router` in the restart tests (no model, so
a start takes a moment): answers GET /health with 200 on its --port, exits 0 on SIGTERM, and
while the file named by $FAKE_CRASH_FILE exists, exits at once with code 3."""

from __future__ import annotations

import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    crash = os.environ.get("FAKE_CRASH_FILE")
    if crash and Path(crash).exists():
        print(f"fake {sys.argv[1]}: {Path(crash).read_text().strip()}", flush=True)
        sys.exit(3)
    port = int(sys.argv[sys.argv.index("--port") + 1])
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    print(f"fake {sys.argv[1]} on port {port}", flush=True)
    ThreadingHTTPServer(("127.0.0.1", port), Health).serve_forever()


if __name__ == "__main__":
    main()
