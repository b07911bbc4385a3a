# SPDX-License-Identifier: Apache-2.0
"""The rerun rule of the engine-test runner: only a worker that vanished without a
Python error is rerun; a defect (any Python error in a worker) never is."""

from tests.helpers.engine_log import port_taken_at_start, worker_died_silently

_MAIN_GONE = """\
Traceback (most recent call last):
  File "tests/helpers/offline_run.py", line 112, in main
    llm = LLM(
  File "vllm/v1/executor/multiproc_executor.py", line 747, in wait_for_ready
    raise e from None
Exception: WorkerProc initialization failed due to an exception in a background \
process. See stack trace for root cause.
"""

# Stop 32's CI log: the worker's last words were oneDNN's, then nothing.
SILENT = (
    "W1202 18:46:01.296000 13993 torch/utils/cpp_extension.py:140] No CUDA runtime\n"
    "[W1202 18:46:05.721512658 utils.cpp:68] Warning: NUMA binding: Using MEMBIND "
    "policy for memory allocation on the NUMA nodes (0).\n" + _MAIN_GONE
)

# A real defect (cpu_keep_dflash_weights off, this machine): the worker says why.
DEFECT = (
    "(Worker pid=17723) ERROR 12-02 19:03:38 [multiproc_executor.py:962] WorkerProc "
    "hit an exception.\n"
    "(Worker pid=17723) ERROR 12-02 19:03:38 [multiproc_executor.py:962] "
    "RuntimeError: size mismatch, got input (40), mat (40x128), vec (0)\n" + _MAIN_GONE
)

TP_DEFECT = (
    "(Worker_TP1 pid=4242) ERROR 12-02 19:03:38 [multiproc_executor.py:870] "
    "WorkerProc failed to start.\n" + _MAIN_GONE
)

DIED_LATER = (
    "(Worker pid=1) INFO 12-02 19:03:37 [cpu_model_runner.py:116] Warming up\n"
    "ERROR 12-02 19:04:00 [multiproc_executor.py:284] Worker proc VllmWorker-0 "
    "died unexpectedly, shutting down executor.\n"
)


def test_silent_worker_death_is_rerun() -> None:
    assert worker_died_silently(1, SILENT)
    assert worker_died_silently(1, DIED_LATER)


def test_python_errors_are_never_rerun() -> None:
    assert not worker_died_silently(1, DEFECT)
    assert not worker_died_silently(1, TP_DEFECT)
    assert not worker_died_silently(1, "TypeError: unexpected keyword argument\n")
    assert not worker_died_silently(0, SILENT)


# CI, 2026-12-07: the worker's TCPStore lost its port to another process.
PORT_TAKEN = (
    "(Worker pid=9963) ERROR 12-07 20:21:19 [multiproc_executor.py:870] "
    "torch.distributed.DistNetworkError: The server socket has failed to listen on "
    "any local network address. port: 45621, useIpv6: false, code: -98, name: "
    "EADDRINUSE, message: address already in use\n" + _MAIN_GONE
)


def test_a_taken_rendezvous_port_is_rerun() -> None:
    assert port_taken_at_start(1, PORT_TAKEN)
    assert not port_taken_at_start(0, PORT_TAKEN)
    assert not port_taken_at_start(1, DEFECT)
    assert not port_taken_at_start(1, SILENT)
    # (a worker error, so not a silent death: only the port rule reruns it)
    assert not worker_died_silently(1, PORT_TAKEN)
