"""A stand-in OpenAI server for client tests (stdlib only, a free port): streams one chunk per token with
vLLM's ``token_ids``, ends with ``finish_reason`` and a usage chunk, and records every request it got."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.json_http import JSONHandler


class FakeOpenAI:
    """``with FakeOpenAI(api_key="k") as srv: srv.url``; ``srv.requests``: (path, headers, body) tuples.

    Without ``ignore_eos`` a request stops ("stop") after ``eos_after`` tokens, as a model that emits
    its end-of-sequence token early; the prompt's token count is its length in ids, or in bytes for text.
    ``token_delay_s``: a pause before each token (a slow server); a client that hangs up ends the stream.
    """

    def __init__(self, model: str = "fake-model", api_key: str | None = None, eos_after: int = 3,
                 token_delay_s: float = 0.0) -> None:
        self.model, self.api_key, self.eos_after = model, api_key, eos_after
        self.token_delay_s = token_delay_s
        self.requests: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "FakeOpenAI":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(JSONHandler):

            def _authorized(self) -> bool:
                if fake.api_key and self.headers.get("Authorization") != f"Bearer {fake.api_key}":
                    self.send_json(401, {"error": {"message": "bad key", "type": "authentication_error"}})
                    return False
                return True

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path != "/v1/models":
                    self.send_json(404, {"error": {"message": "not found", "type": "not_found_error"}})
                elif self._authorized():
                    self.send_json(200, {"object": "list", "data": [{"id": fake.model, "object": "model",
                                                                      "max_model_len": 4096}]})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append((self.path, dict(self.headers), body))
                if not self._authorized():
                    return
                if self.path == "/v1/conflux/stats":
                    return self.send_json(404, {})
                chat = self.path == "/v1/chat/completions"
                prompt = body["messages"][0]["content"] if chat else body["prompt"]
                n_in = len(prompt.encode()) if isinstance(prompt, str) else len(prompt)
                limit = body.get("max_completion_tokens") or body.get("max_tokens")
                n_out = limit if body.get("ignore_eos") else min(limit, fake.eos_after)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in range(n_out):
                    last = i == n_out - 1
                    choice: dict[str, Any] = {"index": 0, "finish_reason": (
                        ("length" if n_out == limit else "stop") if last else None)}
                    choice.update({"delta": {"content": "x"}} if chat else {"text": "x"})
                    if body.get("return_token_ids"):
                        choice["token_ids"] = [100 + i]
                    time.sleep(fake.token_delay_s)
                    try:
                        self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                        self.wfile.flush()
                    except OSError:  # the client hung up
                        return
                usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
                self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
                self.wfile.flush()
                self.close_connection = True

        return Handler
