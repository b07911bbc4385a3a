# SPDX-License-Identifier: Apache-2.0
"""Loggers that go through vLLM's logging configuration (handlers, format)."""

import logging


def init_logger(name: str) -> logging.Logger:
    from vllm.logger import init_logger as vllm_init_logger

    # vLLM configures the "vllm" logger tree only; hang ours under it.
    return vllm_init_logger(f"vllm.plugins.{name}")
