# SPDX-License-Identifier: Apache-2.0
"""Reading an engine subprocess's log: did its CPU worker die without a Python error?

Seen once in CI (stop 32, a fresh 2-core machine): a CPU worker process died right
after oneDNN's "NUMA binding: Using MEMBIND policy" message, before it logged a
single line of its own, and the engine stopped with "WorkerProc initialization
failed". The same configuration passed on the rerun and in every other run. A
worker killed by a signal (the kernel, a native crash in the thread-binding
runtime) leaves no Python traceback behind; a defect in vLLM or in this plugin
always does, because vLLM's worker logs every exception before it exits.
"""

from __future__ import annotations

import re
import subprocess

_WORKER_GONE = re.compile(
    r"WorkerProc initialization failed|Worker proc \S+ died unexpectedly"
)
# vLLM prefixes a worker's Python log lines with "(Worker pid=N)" (or the
# process name with TP > 1) and logs every exception it raises at ERROR.
_WORKER_PYTHON_ERROR = re.compile(
    r"^\((?:Worker|VllmWorker)[^)]*\)\s.*(?:ERROR|Error:|Traceback)", re.MULTILINE
)


def worker_died_silently(returncode: int, log: str) -> bool:
    """True when the engine failed only because a worker process vanished, with
    no Python error from any worker (a machine fault, worth one rerun)."""
    return (
        returncode != 0
        and _WORKER_GONE.search(log) is not None
        and _WORKER_PYTHON_ERROR.search(log) is None
    )


# The worker's distributed rendezvous (torch's TCPStore) could not bind the port
# vLLM had just found free: another process on the machine (the other xdist
# worker's engines and servers bind ephemeral ports too) took it in between.
# Seen once in CI (2026-12-07, a fresh 2-core machine): "DistNetworkError: The
# server socket has failed to listen on any local network address. port: 45621,
# ... EADDRINUSE". A race of the machine, not of the code under test.
_PORT_TAKEN = re.compile(r"DistNetworkError: .*EADDRINUSE")


def port_taken_at_start(returncode: int, log: str) -> bool:
    """True when the engine failed because its rendezvous port was taken between
    vLLM's check and the bind (worth one rerun)."""
    return returncode != 0 and _PORT_TAKEN.search(log) is not None


# The failures worth one rerun, and what the rerun's log says of the first attempt.
_RERUN = (
    (worker_died_silently, "the first attempt's worker died silently"),
    (port_taken_at_start, "the first attempt's rendezvous port was taken"),
)


def run_engine_process(
    cmd: list[str], env: dict[str, str], timeout: float
) -> tuple[int, str]:
    """Run an engine subprocess: (return code, stdout + stderr); -9 on timeout.
    A run whose CPU worker died silently, or whose rendezvous port another
    process took, is run once more, its log marked so."""

    def once() -> tuple[int, str]:
        try:
            proc = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=timeout
            )
            return proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            return -9, f"timeout after {timeout}s\n{e.stdout or ''}{e.stderr or ''}"

    rc, log = once()
    why = next((why for rule, why in _RERUN if rule(rc, log)), None)
    if why:
        first = log
        rc, log = once()
        log = f"[rerun: {why}; its log's tail:]\n{first[-2000:]}\n[rerun log:]\n{log}"
    return rc, log
