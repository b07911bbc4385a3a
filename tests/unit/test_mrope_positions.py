# SPDX-License-Identifier: Apache-2.0
"""DFlash on M-RoPE targets: the drafter's positions/slots follow the token index."""

from __future__ import annotations

import pytest
import torch

from vllm_dflash.registry import original
from vllm_dflash.spec_decode import mrope_positions as mrope

dflash = pytest.importorskip("vllm.v1.spec_decode.dflash")


def test_token_positions():
    # three requests: 4 new tokens after 10 computed, 1 after 3, 2 from scratch
    qsl = torch.tensor([0, 4, 5, 7], dtype=torch.int32)
    seq_lens = torch.tensor([14, 4, 2], dtype=torch.int32)
    pos = mrope.token_positions(qsl, seq_lens, 7)
    assert pos.tolist() == [10, 11, 12, 13, 3, 0, 1]


_capture = mrope.kernel_positions


def test_stock_passes_mrope_rows_and_patch_passes_token_index():
    # After an image, M-RoPE row 0 (here 4, 5, 6) lags the token index (6, 7, 8).
    mrope_pos = torch.tensor([[4, 5, 6], [4, 5, 6], [4, 5, 6]])
    stock = original(dflash.DFlashProposer.set_inputs_first_pass)
    assert mrope.probe()
    assert _capture(stock, mrope_pos).dim() == 2  # the kernel would read row 0
    mrope.apply()
    mrope.apply()  # idempotent
    patched = dflash.DFlashProposer.set_inputs_first_pass
    assert _capture(patched, mrope_pos).tolist() == [6, 7, 8]
    # 1-D (text-only targets): unchanged
    assert _capture(patched, torch.tensor([6, 7, 8])).tolist() == [6, 7, 8]
