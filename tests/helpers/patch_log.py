# SPDX-License-Identifier: Apache-2.0
"""Which process applied which vllm-dflash patch, from an engine's log."""

from __future__ import annotations

import re

# the registry's INFO line: "vllm-dflash V on vLLM V (platform) in PROCESS[pid]:
# [on import of MODULE, ]applied a, b, c[; N wait for their module's import]"
_APPLIED = re.compile(r"vllm-dflash .* in ([\w-]+)\[\d+\]: .*?applied ([\w, ]+)")


def applied_by_process(log: str) -> dict[str, set[str]]:
    """{process name (MainProcess, EngineCore, VllmWorker-0, ...): patches applied}."""
    applied: dict[str, set[str]] = {}
    for m in _APPLIED.finditer(log):
        applied.setdefault(m.group(1), set()).update(m.group(2).split(", "))
    return applied
