# SPDX-License-Identifier: Apache-2.0
"""Start and stop a real ``vllm serve`` process (used by the demo and the tests)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from vllm_dflash.testing.metrics import acceptance_length, fetch_spec_decode

__all__ = ["VllmServer", "acceptance_length", "free_port", "speculative_config_arg"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """``with VllmServer(model, args) as srv: srv.base_url`` — logs go to a file."""

    def __init__(
        self,
        model: str,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        startup_timeout: float = 600.0,
        shell_args: str = "",
    ) -> None:
        """``shell_args``: text appended to the command line unquoted and run
        through ``bash -c``, so bash splits and expands it as it would a typed
        (or ssh-forwarded) line."""
        self.model = model
        self.port = free_port()
        self.extra_args = extra_args or []
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        self.log_path = log_path or Path(f"/tmp/vllm-dflash-serve-{self.port}.log")
        self.startup_timeout = startup_timeout
        self.shell_args = shell_args
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> VllmServer:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", self.model,
            "--host", "127.0.0.1", "--port", str(self.port),
            *self.extra_args,
        ]  # fmt: skip
        if self.shell_args:
            cmd = ["bash", "-c", f"exec {shlex.join(cmd)} {self.shell_args}"]
        self._log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with {self.proc.returncode}; log: {self.log_path}\n"
                    + self.log_tail()
                )
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(
            f"vllm serve not healthy in {self.startup_timeout}s: {self.log_path}"
        )

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(
                self.log_path.read_text(errors="replace").splitlines()[-n:]
            )
        except OSError:
            return ""

    def metrics(self) -> dict[str, float]:
        """Spec-decode counters from /metrics."""
        return fetch_spec_decode(self.base_url)


def speculative_config_arg(drafter: str, k: int) -> list[str]:
    cfg = {"method": "dflash", "model": drafter, "num_speculative_tokens": k}
    return ["--speculative-config", json.dumps(cfg)]
