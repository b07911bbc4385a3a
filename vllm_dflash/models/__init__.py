# SPDX-License-Identifier: Apache-2.0
"""Model classes the plugin registers with vLLM (the DFlash drafter)."""
