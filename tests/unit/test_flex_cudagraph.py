# SPDX-License-Identifier: Apache-2.0
"""dflash_flex_full_cudagraph: with DFlash, vLLM resolves PIECEWISE graphs for
verification batches on FLEX_ATTENTION (the FULL-graph replay crashes on the H200:
H200, 2026-12-01, 1e82751; the GPU check runs it with the patch
on and off). Runs on CPU: vLLM's own cudagraph-mode resolution, no GPU."""

from types import SimpleNamespace

import pytest


@pytest.fixture
def patched(monkeypatch):
    from vllm.v1.attention.backends.flex_attention import (
        FlexAttentionMetadataBuilder as B,
    )

    from vllm_dflash.spec_decode import flex_cudagraph as fc

    monkeypatch.setattr(B, "get_cudagraph_support", B.get_cudagraph_support)
    assert fc.probe(), (
        "this vLLM's FLEX builder no longer claims FULL spec-decode graphs"
    )
    fc.apply()
    fc.apply()  # idempotent
    return B


def _resolve(support, query_len: int):
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CompilationMode, CUDAGraphMode

    cc = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        cudagraph_capture_sizes=[6, 12, 24],
        max_cudagraph_capture_size=24,
    )
    cc.splitting_ops = list(cc._attention_ops)  # attention split out, as on CUDA
    return cc.resolve_cudagraph_mode_and_sizes(support, "FLEX_ATTENTION", query_len)


def test_dflash_on_flex_gets_piecewise_verification_graphs(patched):
    from vllm.config.compilation import CUDAGraphMode

    dflash = SimpleNamespace(speculative_config=SimpleNamespace(method="dflash"))
    eagle = SimpleNamespace(speculative_config=SimpleNamespace(method="eagle3"))
    plain = SimpleNamespace(speculative_config=None)
    got = patched.get_cudagraph_support(dflash, None)
    assert _resolve(got, 6) == CUDAGraphMode.PIECEWISE
    # Other configurations keep vLLM's behaviour (FULL decode graphs).
    for cfg in (eagle, plain):
        assert _resolve(patched.get_cudagraph_support(cfg, None), 6).decode_mode() == (
            CUDAGraphMode.FULL
        )
    # One-token decode (no speculation) would still get FULL graphs.
    assert _resolve(got, 1).decode_mode() == CUDAGraphMode.FULL
