# SPDX-License-Identifier: Apache-2.0
"""DFlash speculative decoding: backports and fixes of vLLM's spec-decode path."""

from typing import Any


def uses_dflash(owner: Any) -> bool:
    """Whether ``owner`` runs DFlash: anything with a ``speculative_config`` (a
    model runner, a metadata builder, a layer, a ``VllmConfig``)."""
    spec = getattr(owner, "speculative_config", None)
    return spec is not None and getattr(spec, "method", None) == "dflash"
