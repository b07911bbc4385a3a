# SPDX-License-Identifier: Apache-2.0
"""Command-line entry points: vLLM's argument parsing and the vllm-dflash command."""
