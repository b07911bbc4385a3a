# SPDX-License-Identifier: Apache-2.0
"""The GDN prefill kernel the GPU scripts ask vLLM for (Qwen3.5/3.6 hybrid targets).

vLLM 0.20.1 (``ChunkGatedDeltaRule`` in
``vllm/model_executor/layers/mamba/gdn_linear_attn.py``) uses FlashInfer's
``chunk_gated_delta_rule`` on sm90 whenever ``gdn_prefill_backend`` is unset or
``"auto"``, without checking that flashinfer is installed or that its JIT module
can be built; elsewhere, or with ``"triton"``, FLA's Triton kernel. Its
``has_flashinfer()`` (nvcc or flashinfer-cubin) is not consulted there. So:

* ``GDN_PREFILL`` (env, set by ``device_run.sh``): ``auto`` (default), ``flashinfer``
  or ``triton``; an explicit value is passed to vLLM as is;
* ``auto``: leave vLLM's default (FlashInfer on Hopper) when FlashInfer can run its
  GDN prefill without compiling or can compile it (:func:`flashinfer_usable`), else
  force ``triton`` (the vLLM bundle alone has no flashinfer);
* :func:`from_log` reads which kernel the engine chose from its log (vLLM logs it
  once per process when the GDN layers are built).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

ENV = "GDN_PREFILL"
CHOICES = ("auto", "flashinfer", "triton")
# flashinfer's JitSpec.aot_path for gen_gdn_prefill_sm90_module() (flashinfer/jit/core.py):
# FLASHINFER_AOT_DIR (= <package>/data/aot without flashinfer-jit-cache) / name / name.so
AOT_REL = Path("data/aot/gdn_prefill_sm90/gdn_prefill_sm90.so")
LOG_LINES = {
    "flashinfer": "Using FlashInfer GDN prefill kernel",
    "triton": "Using Triton/FLA GDN prefill kernel",
}


def flashinfer_usable() -> tuple[bool, str]:
    """Whether flashinfer can run its sm90 GDN prefill here, without importing it
    (no CUDA initialisation in the calling process)."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return False, "flashinfer not installed"
    pkg = Path(next(iter(spec.submodule_search_locations)))
    if (pkg / AOT_REL).is_file():
        return True, f"prebuilt module {pkg / AOT_REL}"
    if importlib.util.find_spec("flashinfer_jit_cache") is not None:
        return True, "flashinfer-jit-cache installed"
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or ""
    if shutil.which("nvcc") or (cuda_home and Path(cuda_home, "bin/nvcc").exists()):
        return True, "flashinfer JIT (nvcc found)"
    return False, f"flashinfer at {pkg} has no prebuilt gdn_prefill_sm90 and no nvcc"


def choose(requested: str | None = None) -> str | None:
    """``gdn_prefill_backend`` to pass to vLLM: ``None`` = vLLM's default (FlashInfer
    on sm90), ``"triton"`` or ``"flashinfer"``. ``requested`` (or ``$GDN_PREFILL``):
    one of :data:`CHOICES`; empty means ``auto``."""
    req = (requested or os.environ.get(ENV) or "auto").strip().lower()
    if req not in CHOICES:
        raise ValueError(f"{ENV}={req!r}: expected one of {CHOICES}")
    if req != "auto":
        return req
    return None if flashinfer_usable()[0] else "triton"


def from_log(text: str) -> str | None:
    """``"flashinfer"``, ``"triton"`` (both, comma-joined, if processes differed), or
    None when the log does not say (no GDN layer built, or logging off)."""
    found = sorted(name for name, line in LOG_LINES.items() if line in text)
    return ",".join(found) or None


def describe() -> dict:
    """What ``auto`` sees here (for result files)."""
    ok, why = flashinfer_usable()
    return {"requested": os.environ.get(ENV) or "auto", "flashinfer_usable": ok,
            "why": why, "passed": choose()}  # fmt: skip
