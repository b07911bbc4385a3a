# SPDX-License-Identifier: Apache-2.0
"""vllm-dflash: DFlash speculative decoding fixes for vLLM 0.20.x, as a plugin.

vLLM calls :func:`register` (entry point group ``vllm.general_plugins``) once in
every process it starts: the CLI/API server, the engine core and each worker.
"""

from vllm_dflash.version import __version__

__all__ = ["__version__", "register"]


def register() -> None:
    """Apply the patch registry. Idempotent; cheap after the first call."""
    from vllm_dflash.catalog import PATCHES
    from vllm_dflash.registry import apply_all

    apply_all(PATCHES)
