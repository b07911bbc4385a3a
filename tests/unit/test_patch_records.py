# SPDX-License-Identifier: Apache-2.0
"""Each patch record says what its code changes (records live beside the code),
and the trace hook starts its file afresh."""

from __future__ import annotations

import json

import pytest

from tests.conftest import _resolve
from vllm_dflash.catalog import PATCHES
from vllm_dflash.registry import PatchState, evaluate, is_patched
from vllm_dflash.spec_decode.trace import TraceWriter


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_declared_targets_are_what_apply_changes(patch, isolated, monkeypatch):
    """Apply each patch alone: every declared target now carries the patch's
    mark (a record that drifted from its code fails here)."""
    if patch.name == "dflash_trace":
        monkeypatch.setenv("VLLM_DFLASH_TRACE", "/dev/null")
    if patch.name == "dflash_step_profile":
        monkeypatch.setenv("VLLM_DFLASH_PROFILE", "/dev/null")
    if patch.name == "dflash_step_log":
        monkeypatch.setenv("VLLM_DFLASH_STEP_LOG", "/dev/null")
    for target in patch.targets:
        _resolve(target)  # the owner exists in this vLLM
    isolated(patch)
    state = evaluate(patch, apply=False).state
    if state is not PatchState.APPLIED:
        pytest.skip(f"{patch.name}: {state.value} here")
    patch.apply()
    for target in patch.targets:
        owner, attr = _resolve(target)
        if isinstance(owner, dict):
            value = owner[attr]
        elif isinstance(owner, type) and attr in owner.__dict__:
            value = owner.__dict__[attr]  # the raw classmethod/staticmethod
        else:
            value = getattr(owner, attr)
        marked = (
            is_patched(value, patch.name)
            or is_patched(getattr(value, "__func__", None), patch.name)
            or is_patched(getattr(value, "fget", None), patch.name)
            or getattr(value, "module_name", "").startswith("vllm_dflash")
        )
        assert marked, f"{patch.name}: {target} is declared but apply() left it alone"


def test_trace_file_starts_afresh(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"request_id": "stale"}) + "\n")
    writer = TraceWriter(str(path))
    writer.write([{"request_id": "a"}])
    writer.write([{"request_id": "b"}])
    ids = [json.loads(x)["request_id"] for x in path.read_text().splitlines()]
    assert ids == ["a", "b"]
