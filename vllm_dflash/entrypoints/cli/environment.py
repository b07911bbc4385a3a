# SPDX-License-Identifier: Apache-2.0
"""Checks of the vLLM installation that ``vllm-dflash doctor`` reports.

Not patches: these find packages a trimmed environment left out, which break a
serving feature with or without DFlash.
"""

from __future__ import annotations

import importlib

# vLLM 0.20.x validates every structured-output request in
# ``SamplingParams._validate_structured_outputs``, which imports the validators of
# all four backends whatever backend is configured. ``backend_lm_format_enforcer``
# evaluates a ``lmformatenforcer`` annotation at import, so without that package
# each structured-output request ends in HTTP 500 with an empty message.
STRUCTURED_OUTPUT_MODULES: dict[str, str] = {
    "vllm.v1.structured_output.backend_guidance": "llguidance",
    "vllm.v1.structured_output.backend_lm_format_enforcer": "lm-format-enforcer",
    "vllm.v1.structured_output.backend_outlines": "outlines_core",
    "vllm.v1.structured_output.backend_xgrammar": "xgrammar",
}


def structured_outputs() -> str:
    """``ok`` when a structured-output request can be validated here, else which
    module failed to import and the package to install."""
    missing = []
    for module, package in STRUCTURED_OUTPUT_MODULES.items():
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - reported, never raised
            missing.append(f"{module.rsplit('.', 1)[1]}: {type(e).__name__}: {e}"
                           f" (pip install {package})")  # fmt: skip
    if not missing:
        return "ok"
    return "every structured-output request fails (HTTP 500): " + "; ".join(missing)
