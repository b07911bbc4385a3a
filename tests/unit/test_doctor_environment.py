# SPDX-License-Identifier: Apache-2.0
"""``vllm-dflash doctor``'s structured-output check: a package that vLLM 0.20.x
imports for every structured-output request is named when it is missing."""

from __future__ import annotations

import sys

import pytest

from vllm_dflash.entrypoints.cli import environment


def test_structured_outputs_ok_here():
    assert environment.structured_outputs() == "ok"


def test_missing_lm_format_enforcer_is_named(monkeypatch):
    # a fresh import of vLLM's backend module with the package unimportable
    backend = "vllm.v1.structured_output.backend_lm_format_enforcer"
    monkeypatch.delitem(sys.modules, backend, raising=False)
    monkeypatch.setitem(sys.modules, "lmformatenforcer", None)
    out = environment.structured_outputs()
    assert out.startswith("every structured-output request fails (HTTP 500)")
    assert "backend_lm_format_enforcer" in out
    assert "pip install lm-format-enforcer" in out
    assert "backend_xgrammar" not in out


def test_request_validation_fails_the_same_way(monkeypatch):
    """The check matches what vLLM does with a request: without the package a
    JSON-schema request fails validation although the backend is xgrammar."""
    from transformers import AutoTokenizer
    from vllm.config import StructuredOutputsConfig
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    from vllm_dflash.testing.trained import SHIPPED

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED / "target")

    backend = "vllm.v1.structured_output.backend_lm_format_enforcer"
    monkeypatch.delitem(sys.modules, backend, raising=False)
    monkeypatch.setitem(sys.modules, "lmformatenforcer", None)
    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(json={"type": "object"})
    )
    with pytest.raises(ImportError):
        params._validate_structured_outputs(
            StructuredOutputsConfig(backend="xgrammar"), tokenizer=tokenizer
        )
    # and with the package importable the same request validates
    monkeypatch.delitem(sys.modules, "lmformatenforcer")
    params._validate_structured_outputs(
        StructuredOutputsConfig(backend="xgrammar"), tokenizer=tokenizer
    )
