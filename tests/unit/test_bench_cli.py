# SPDX-License-Identifier: Apache-2.0
"""``vllm-dflash bench`` sends what its flags say, over real HTTP.

The server here is a minimal OpenAI-compatible endpoint that records the request
bodies (the end-to-end run against ``vllm serve`` is tests/e2e/test_server.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class _Recorder(BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # /metrics: no spec-decode counters
        self._send(200, "text/plain", b"")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        n = body["max_tokens"]
        chunks = [
            {"id": "c", "object": "text_completion", "created": 0, "model": "m",
             "choices": [{"index": 0, "text": "a", "finish_reason": None}]},
            {"id": "c", "object": "text_completion", "created": 0, "model": "m",
             "choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
            {"id": "c", "object": "text_completion", "created": 0, "model": "m",
             "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n,
                                      "total_tokens": n + 1}},
        ]  # fmt: skip
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        self._send(200, "text/event-stream", sse.encode())

    def _send(self, code: int, ctype: str, data: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def server():
    _Recorder.bodies = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", _Recorder.bodies
    srv.shutdown()


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_bench_ignore_eos_reaches_the_server(server, tmp_path, ignore_eos):
    url, bodies = server
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    cmd = [
        sys.executable, "-m", "vllm_dflash.entrypoints.cli.main", "bench", "--base-url", url,
        "--model", "m", "--prompts", str(prompts), "--num-prompts", "3",
        "--max-tokens", "7",
    ] + (["--ignore-eos"] if ignore_eos else [])  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert len(bodies) == 3 and all(b["max_tokens"] == 7 for b in bodies)
    assert [b.get("ignore_eos", False) for b in bodies] == [ignore_eos] * 3
