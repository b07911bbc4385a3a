# SPDX-License-Identifier: Apache-2.0
"""Attention metadata builders (vLLM's v1/attention/backends)."""
