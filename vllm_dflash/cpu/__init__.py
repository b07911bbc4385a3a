# SPDX-License-Identifier: Apache-2.0
"""Fixes that let speculative decoding (EAGLE-3, DFlash) run on vLLM's CPU backend."""
