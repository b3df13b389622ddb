"""A quiet ``BaseHTTPRequestHandler`` that answers JSON: the base of the tests' stand-in servers
(tests/serve/fake_openai.py, tests/ops/test_grafana_push.py)."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler


class JSONHandler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:  # quiet
        pass

    def send_json(self, status: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
