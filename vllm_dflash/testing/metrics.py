# SPDX-License-Identifier: Apache-2.0
"""Spec-decode counters from a vLLM server's Prometheus ``/metrics``."""

from __future__ import annotations

import re
import urllib.request

_LINE = re.compile(
    r"^(vllm:spec_decode_[a-z_]+?)(?:_total)?(\{[^}]*\})? ([0-9.eE+-]+)$"
)


def parse_spec_decode(text: str) -> dict[str, float]:
    """Counters summed over label sets (per-position counters kept apart)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        name = m.group(1)
        if name.endswith("_created"):
            continue  # Prometheus creation timestamps, not counts
        pos = re.search(r'position="(\d+)"', m.group(2) or "")
        if pos:
            name = f"{name}[{pos.group(1)}]"
        out[name] = out.get(name, 0.0) + float(m.group(3))
    return out


def fetch_spec_decode(base_url: str, timeout: float = 10.0) -> dict[str, float]:
    with urllib.request.urlopen(
        base_url.rstrip("/") + "/metrics", timeout=timeout
    ) as r:
        return parse_spec_decode(r.read().decode())


def acceptance_length(counters: dict[str, float]) -> float | None:
    """Mean tokens per drafting step: accepted / drafts + 1."""
    drafts = counters.get("vllm:spec_decode_num_drafts", 0.0)
    if not drafts:
        return None
    return counters.get("vllm:spec_decode_num_accepted_tokens", 0.0) / drafts + 1.0


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}
