# SPDX-License-Identifier: Apache-2.0
"""DFlash on M-RoPE targets: the drafter's positions/slots follow the token index."""

from __future__ import annotations

import pytest
import torch

from vllm_dflash.cpu.dflash_inputs import TRITON_SHIM
from vllm_dflash.registry import original
from vllm_dflash.spec_decode import mrope_positions as mrope

dflash = pytest.importorskip("vllm.v1.spec_decode.dflash")


def test_token_positions():
    # three requests: 4 new tokens after 10 computed, 1 after 3, 2 from scratch
    qsl = torch.tensor([0, 4, 5, 7], dtype=torch.int32)
    seq_lens = torch.tensor([14, 4, 2], dtype=torch.int32)
    pos = mrope.token_positions(qsl, seq_lens, 7)
    assert pos.tolist() == [10, 11, 12, 13, 3, 0, 1]


def _capture(method, positions):
    """Run a set_inputs_first_pass up to the kernel launch; return what it gets."""
    seen = {}

    class _Stop(Exception):
        pass

    class _Kernel:
        def __getitem__(self, grid):
            def launch(**kw):
                seen["pos"] = kw["target_positions_ptr"].clone()
                raise _Stop

            return launch

    class _Cad:
        max_query_len = 3
        query_start_loc = torch.tensor([0, 3], dtype=torch.int32)
        seq_lens = torch.tensor([9], dtype=torch.int32)
        block_table_tensor = torch.zeros(1, 4, dtype=torch.int32)

        @staticmethod
        def batch_size() -> int:
            return 1

    class _Fake(dflash.DFlashProposer):
        def __getattr__(self, name: str):  # buffers the launch arguments name
            return None

    fake = object.__new__(_Fake)
    fake.num_speculative_tokens = 2
    fake.device = torch.device("cpu")
    saved = dflash.copy_and_expand_dflash_inputs_kernel, dflash.triton
    dflash.copy_and_expand_dflash_inputs_kernel = _Kernel()
    if not hasattr(dflash.triton, "next_power_of_2"):
        dflash.triton = TRITON_SHIM
    try:
        method(
            fake, torch.zeros(3, dtype=torch.long), torch.zeros(1, dtype=torch.long),
            positions, torch.zeros(3, 4), None, _Cad(), None,
        )  # fmt: skip
    except _Stop:
        pass
    finally:
        dflash.copy_and_expand_dflash_inputs_kernel, dflash.triton = saved
    return seen["pos"]


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
