# SPDX-License-Identifier: Apache-2.0
"""dflash_query_buffer_padding (#50065): DFlash query buffers hold a drafter batch
padded to the largest CUDA-graph capture size. vLLM's own slicing methods show
the defect and the fix on CPU; the H200 check starts an engine with
max_num_seqs=33, k=3 with the patch on and off (benchmarks/gpu/gpu_check.py)."""

from types import SimpleNamespace

import pytest
import torch

from vllm_dflash.registry import is_patched
from vllm_dflash.spec_decode import query_buffers as qb


def _compilation(mode_name: str, max_size: int | None):
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    sizes = [1, 2, 4] + list(range(8, (max_size or 8) + 1, 8))
    return CompilationConfig(
        cudagraph_mode=getattr(CUDAGraphMode, mode_name),
        cudagraph_capture_sizes=sizes if max_size else None,
        max_cudagraph_capture_size=max_size,
    )


def _proposer(max_seqs: int, k: int, compilation):
    """The attributes DFlashProposer.__init__ leaves that the patch reads."""
    n = max_seqs * (1 + k)
    return SimpleNamespace(
        max_query_tokens=n,
        positions=torch.zeros(n, dtype=torch.int64),
        _slot_mapping_buffer=torch.zeros(n, dtype=torch.int64),
        uses_mrope=False,
        uses_xdrope_dim=0,
        vllm_config=SimpleNamespace(compilation_config=compilation),
    )


def test_padded_batch_gets_full_length_slices():
    from vllm.v1.spec_decode.dflash import DFlashProposer

    p = _proposer(33, 3, _compilation("FULL_AND_PIECEWISE", 136))
    padded = 136  # 33 * (1 + 3) = 132 query tokens, the next capture size is 136
    # The defect, through vLLM's own method: a short positions tensor.
    assert DFlashProposer._get_positions(p, padded).shape[0] == 132
    assert qb.grow_query_buffers(p) == padded
    assert DFlashProposer._get_positions(p, padded).shape[0] == padded
    assert p._slot_mapping_buffer[:padded].shape[0] == padded
    assert p.positions.dtype == torch.int64 and not p.positions.any()


@pytest.mark.parametrize(
    "mode, max_size, want",
    [("NONE", 136, 132), ("FULL_AND_PIECEWISE", 128, 132), ("PIECEWISE", 512, 512)],
)
def test_capacity_follows_the_graph_mode(mode, max_size, want):
    p = _proposer(33, 3, _compilation(mode, max_size))
    assert qb.grow_query_buffers(p) == want
    assert p.positions.shape[0] == want  # never shrinks below the query bound


def test_apply_wraps_init_and_probe_reads_stock(isolated, monkeypatch):
    from vllm.v1.spec_decode.dflash import DFlashProposer

    assert qb.probe(), "this vLLM already sizes DFlash buffers by the capture size"
    isolated(qb.PATCH)

    def fake_init(self, vllm_config, device, runner=None):
        self.__dict__.update(vars(_proposer(33, 3, vllm_config.compilation_config)))
        self.vllm_config = vllm_config

    monkeypatch.setattr(DFlashProposer, "__init__", fake_init)
    qb.apply()
    qb.apply()  # idempotent
    assert is_patched(DFlashProposer.__init__, qb.NAME)
    cfg = SimpleNamespace(compilation_config=_compilation("FULL_AND_PIECEWISE", 136))
    p = DFlashProposer(cfg, torch.device("cpu"))
    assert p.positions.shape[0] == 136 and p._slot_mapping_buffer.shape[0] == 136
    assert qb.probe(), "the probe must read vLLM's own __init__, not the wrapper"
