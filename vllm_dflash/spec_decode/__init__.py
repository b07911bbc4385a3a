# SPDX-License-Identifier: Apache-2.0
"""DFlash speculative decoding: backports and fixes of vLLM's spec-decode path."""
