# SPDX-License-Identifier: Apache-2.0
"""dflash_flex_hybrid_kv_layout on CUDA: vLLM's FLEX_ATTENTION (compiled Triton
kernel) on the hybrid K/V-interleaved cache, the cases of
``tests/unit/test_flex_hybrid_kv.py`` (there with torch's eager flex_attention on
CPU). The patch is applied as a CUDA worker applies it (registry, so
``VLLM_DFLASH_DISABLE=dflash_flex_hybrid_kv_layout`` turns the first test red with
the stock 'view size is not compatible' error). Skipped without a GPU."""

from __future__ import annotations

import pytest

from tests.unit import test_flex_hybrid_kv as cases
from vllm_dflash.registry import evaluate
from vllm_dflash.spec_decode import flex_hybrid_kv as fh

pytestmark = pytest.mark.gpu


@pytest.fixture
def flex():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from vllm.v1.attention.backends import flex_attention

    return flex_attention


def test_flex_reads_the_hybrid_layout_cuda(flex, isolated):
    isolated(fh.PATCH)
    state = evaluate(fh.PATCH, apply=True).state.value
    assert state in ("applied", "disabled"), state
    cases.check_hybrid_layout(flex, fh.INTERLEAVED_ATTR, device="cuda")


def test_stock_flex_cannot_read_the_hybrid_layout_cuda(flex, isolated):
    isolated(fh.PATCH)  # stock classes
    for cls, name in ((flex.FlexAttentionMetadataBuilder, "build"),
                      (flex.FlexAttentionImpl, "forward")):  # fmt: skip
        setattr(cls, name, fh.original(getattr(cls, name)))
    cases.check_stock_defect(flex, device="cuda")
