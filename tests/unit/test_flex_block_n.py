# SPDX-License-Identifier: Apache-2.0
"""dflash_flex_kernel_block_n: vLLM's FLEX_ATTENTION kernel options for the block
sizes hybrid targets get (304, 480: aligned to the mamba page) are tiles Triton
can compile (powers of two dividing the block). vLLM's own ``get_kernel_options``
is called, stock and patched; with ``VLLM_DFLASH_DISABLE=dflash_flex_kernel_block_n``
the patched-behaviour test fails with the stock tile (BLOCK_N = 304). The CUDA
kernel itself runs in the GPU check (benchmarks/gpu/gpu_check.py, hybrid fp32 runs).
"""

from __future__ import annotations

import pytest
import torch

from vllm_dflash import envs


@pytest.fixture(scope="module")
def flex():
    try:
        from vllm.v1.attention.backends import flex_attention
    except Exception as exc:  # pragma: no cover - depends on the vLLM build
        pytest.skip(f"vLLM's FLEX_ATTENTION backend does not import here: {exc}")
    if not hasattr(flex_attention, "get_kernel_options"):
        pytest.skip("this vLLM's FLEX_ATTENTION has no get_kernel_options")
    return flex_attention


@pytest.fixture
def patched(flex, isolated):
    from vllm_dflash.spec_decode import flex_block_n as fb

    isolated(fb.PATCH)
    assert fb.probe(), "this vLLM's FLEX kernel options are already powers of two"
    if fb.PATCH_NAME not in envs.disabled_patches():  # disabled: the stock code runs
        fb.apply()
        fb.apply()  # idempotent
    assert fb.probe()  # the probe asks the unpatched function
    return fb


def test_tiles():
    from vllm_dflash.spec_decode.flex_block_n import compilable, power_of_two_tile

    assert [power_of_two_tile(n) for n in (304, 480, 16, 128, 272, 96)] == [
        16, 32, 16, 128, 16, 32,
    ]  # fmt: skip
    opts = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 16, "BLOCK_N": 304}
    assert compilable(opts) == {**opts, "BLOCK_N": 16}
    assert compilable({"BLOCK_M": 64, "BLOCK_N": 128}) == {
        "BLOCK_M": 64,
        "BLOCK_N": 128,
    }


@pytest.mark.parametrize("block", [304, 480, 16, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_tiles_compile_for_hybrid_blocks(flex, patched, block, dtype):
    query = torch.zeros(1, 2, 5, 128, dtype=dtype)
    opts = flex.get_kernel_options(query, 16, block, True)  # direct build
    for key in ("BLOCK_M", "BLOCK_N"):
        tile = opts[key]
        assert tile & (tile - 1) == 0, f"{key}={tile}: Triton's tl.arange needs 2^n"
    assert block % opts["BLOCK_N"] == 0
    if block & (block - 1) == 0:  # powers of two: vLLM's options unchanged
        stock = patched.original(flex.get_kernel_options)
        assert opts == stock(query, 16, block, True)


def test_stock_options_do_not_compile(flex, isolated):
    from vllm_dflash.spec_decode import flex_block_n as fb

    isolated(fb.PATCH)
    stock = fb.original(flex.get_kernel_options)
    opts = stock(torch.zeros(1, 2, 5, 128), 16, 304, True)
    assert opts["BLOCK_N"] == 304  # the tile the H200 run failed to compile
