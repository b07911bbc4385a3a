# SPDX-License-Identifier: Apache-2.0
"""Changes to vLLM's front-end engine (``vllm/v1/engine``): output processing."""
