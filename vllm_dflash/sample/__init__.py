# SPDX-License-Identifier: Apache-2.0
"""Fixes of vLLM's sampling (``vllm.v1.sample``) for DFlash steps of k + 1 tokens."""
