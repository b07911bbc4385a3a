# SPDX-License-Identifier: Apache-2.0
"""Model layers (vLLM's model_executor/layers): Gated-DeltaNet state replay."""
