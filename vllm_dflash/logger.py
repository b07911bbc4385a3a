# SPDX-License-Identifier: Apache-2.0
"""Loggers that go through vLLM's logging configuration (handlers, format)."""

import contextlib
import logging
from collections.abc import Iterator


def init_logger(name: str) -> logging.Logger:
    from vllm.logger import init_logger as vllm_init_logger

    # vLLM configures the "vllm" logger tree only; hang ours under it.
    return vllm_init_logger(f"vllm.plugins.{name}")


@contextlib.contextmanager
def vllm_logs_silenced() -> Iterator[None]:
    """vLLM's log lines below ERROR off for the duration. For probes that build
    throwaway vLLM objects (a VllmConfig, a Scheduler): their INFO and WARNING
    lines would reach the log of every vLLM user, DFlash or not, and describe a
    configuration that is not the user's."""
    tree = logging.getLogger("vllm")
    level = tree.level
    tree.setLevel(logging.ERROR)
    try:
        yield
    finally:
        tree.setLevel(level)
