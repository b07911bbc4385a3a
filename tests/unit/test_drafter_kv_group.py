# SPDX-License-Identifier: Apache-2.0
"""dflash_drafter_kv_shared_group: which drafter specs join the target's type,
and the re-view of their blocks with the drafter's own heads (every element of
the drafter's view is a distinct element of the same block, in CPU and
FlashAttention layouts). The engine run: tests/e2e/test_hybrid.py."""

from __future__ import annotations

import pytest
import torch

from vllm_dflash.spec_decode import drafter_kv_group as g


def _attn(heads: int, size: int, dtype=torch.bfloat16, block: int = 16):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(
        block_size=block, num_kv_heads=heads, head_size=size, dtype=dtype
    )


def _mamba(copies: int):
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        shapes=((4,),), dtypes=(torch.float32,), block_size=16,
        num_speculative_blocks=copies,
    )  # fmt: skip


def test_merge_equal_bytes_only():
    specs = {"t.0": _attn(4, 256), "t.1": _attn(4, 256), "m.0": _mamba(0)}
    drafter = {"d.0": _attn(8, 128), "d.1": _attn(8, 128)}
    merged, true = g.merge_specs(specs | drafter, set(drafter))
    assert merged["d.0"] == specs["t.0"] and merged["d.1"] == specs["t.0"]
    assert true == {"d.0": (8, 128), "d.1": (8, 128)}
    # other bytes per token, other dtype, identical spec, several target types
    for d in (_attn(8, 64), _attn(8, 128, torch.float32), _attn(4, 256)):
        merged, true = g.merge_specs(specs | {"d.0": d}, {"d.0"})
        assert merged["d.0"] == d and true == {}
    two = specs | {"t.2": _attn(2, 512, block=32)} | drafter
    assert g.merge_specs(two, set(drafter))[1] == {}


def test_no_merge_next_to_speculative_gdn_copies():
    specs = {"t.0": _attn(4, 256), "m.0": _mamba(15), "d.0": _attn(8, 128)}
    merged, true = g.merge_specs(specs, {"d.0"})
    assert true == {} and merged == specs


class _FlashLayout:
    """FlashAttention's shape (its class needs CUDA to import)."""

    @staticmethod
    def get_name():
        return "FLASH_ATTN"

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, **_):
        return (2, num_blocks, block_size, num_kv_heads, head_size)


def _cpu_backend():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return CPUAttentionBackend


@pytest.mark.parametrize("layout", ["cpu", "flash", "flash-hybrid"])
def test_reshape_is_a_bijection_per_block(layout):
    backend = _cpu_backend() if layout == "cpu" else _FlashLayout
    nb, bs, merged, own = 5, 32, (2, 64), (4, 32)
    shape = backend.get_kv_cache_shape(nb, bs, *merged)
    n = 1
    for s in shape:
        n *= s
    raw = torch.zeros(n, dtype=torch.float32)
    cache = raw.view(shape)
    if layout == "flash-hybrid":
        # vLLM's hybrid layout: (num_blocks, 2, ...) in memory, logical (2, nb, ...)
        cache = raw.view(nb, 2, bs, *merged).transpose(0, 1)
    view = g.reshape_for_layer(cache, backend, merged, own)
    assert view.shape == backend.get_kv_cache_shape(nb, bs, *own)
    view.copy_(torch.arange(n, dtype=torch.float32).view(view.shape))
    assert torch.equal(raw.sort().values, torch.arange(n, dtype=torch.float32))
    for kv in range(2):  # each (K/V, block) of the view stays in that block's bytes
        for b in range(nb):
            got = set(view[kv, b].flatten().tolist())
            assert got == set(cache[kv, b].flatten().tolist())


def test_reshape_refuses_a_non_contiguous_block():
    cache = torch.zeros(2, 3, 16, 8, 4).transpose(3, 4)  # dims (4, 8) swapped
    with pytest.raises(g.PatchError, match="not contiguous"):
        g.reshape_for_layer(cache, _FlashLayout, (4, 8), (2, 16))


def test_own_spec_keeps_everything_but_heads():
    group = _attn(4, 256, block=544)
    assert g.own_spec(group, _attn(4, 256)) is None
    own = g.own_spec(group, _attn(8, 128))
    assert (own.num_kv_heads, own.head_size, own.block_size) == (8, 128, 544)
    assert own.page_size_bytes == group.page_size_bytes
    assert g.probe()


def test_probe_sees_a_vllm_that_merges_itself(monkeypatch):
    """patches/v0.20.1/0018 adds share_drafter_kv_cache_group: not needed there."""
    import vllm.v1.worker.utils as worker_utils

    assert g.probe()
    monkeypatch.setattr(
        worker_utils, "share_drafter_kv_cache_group", lambda *a: None, raising=False
    )
    assert not g.probe()


def test_cuda_graph_profiling_cache_keeps_vllms_groups():
    """vLLM sizes its graph-profiling KV cache in blocks per layer slot of a group:
    a merged 21-layer group made it 22.9 GiB on the 27B pair (out of memory on an
    80 GB GPU). While that cache is built the runner's specs are vLLM's own; the
    real cache is merged again."""
    from types import SimpleNamespace

    specs = {"t.0": _attn(4, 256), "m.0": _mamba(0), "d.0": _attn(8, 128)}
    runner = SimpleNamespace(
        speculative_config=SimpleNamespace(method="dflash"),
        drafter=SimpleNamespace(_draft_attn_layer_names=["d.0"]),
    )
    seen = []

    def stock(r):  # vLLM's _init_minimal_kv_cache_for_profiling reads the specs
        seen.append(g.runner_specs(r, specs))
        seen.append(getattr(r, g.TRUE_SHAPES_ATTR))  # its blocks: not re-viewed

    # the engine core asks for the specs once, before profiling (merged) ...
    assert g.runner_specs(runner, specs)["d.0"] == specs["t.0"]
    g.profiling_cache(runner, stock)
    assert seen == [specs, {}]  # vLLM's own grouping for the profiling cache
    # ... and builds the real (merged) cache after it without asking again
    assert getattr(runner, g.TRUE_SHAPES_ATTR) == {"d.0": (8, 128)}
    assert g.runner_specs(runner, specs)["d.0"] == specs["t.0"]
