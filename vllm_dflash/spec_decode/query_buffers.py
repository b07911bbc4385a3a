# SPDX-License-Identifier: Apache-2.0
"""DFlash query buffers sized for CUDA-graph-padded drafter batches (#50065).

``DFlashProposer.__init__`` sizes its query-token buffers (``positions`` and
``_slot_mapping_buffer``) to ``max_num_seqs * (1 + k)``. With CUDA graphs the
drafter batch is padded up to the next capture size, which is larger whenever
``max_num_seqs * (1 + k)`` is not a capture size itself (``max_num_seqs=33``,
``k=3``: 132 query tokens padded to 136). Slicing the buffers at the padded size
returns short tensors: the start-up dummy run or a full step then fails on
mismatched shapes.

Fix (as upstream vllm-project/vllm#50065): with CUDA graphs on, the two query
buffers hold at least ``max_cudagraph_capture_size`` tokens (dispatch never pads
past it). ``max_query_tokens`` keeps its meaning (the real query bound).
"""

from __future__ import annotations

import torch

from vllm_dflash.registry import (
    V020,
    Patch,
    PatchKind,
    code_reads,
    original,
    replace_attr,
)

NAME = "dflash_query_buffer_padding"
QUERY_BUFFERS = ("positions", "_slot_mapping_buffer")


def probe() -> bool:
    """Whether the running ``DFlashProposer.__init__`` never consults the CUDA
    graph capture size (the defect: buffers sized by the query bound only)."""
    from vllm.v1.spec_decode.dflash import DFlashProposer

    init = original(DFlashProposer.__init__)
    return not code_reads(init, "max_cudagraph_capture_size")


def padded_capacity(proposer) -> int:
    """Tokens the query buffers must hold: the query bound, or the largest CUDA
    graph capture size when drafter graphs may be padded up to it."""
    from vllm.config import CUDAGraphMode

    cap = proposer.max_query_tokens
    compilation = proposer.vllm_config.compilation_config
    if compilation.cudagraph_mode != CUDAGraphMode.NONE:
        cap = max(cap, compilation.max_cudagraph_capture_size or 0)
    return cap


def grow_query_buffers(proposer) -> int:
    """Reallocate the query buffers (zeros, same dtype/device) to
    :func:`padded_capacity` if they are smaller; returns the capacity. Runs at the
    end of ``__init__``: nothing holds the buffers' addresses yet."""
    cap = padded_capacity(proposer)
    for attr in QUERY_BUFFERS:
        buf: torch.Tensor = getattr(proposer, attr)
        if buf.shape[0] < cap:
            setattr(
                proposer,
                attr,
                torch.zeros(cap, *buf.shape[1:], dtype=buf.dtype, device=buf.device),
            )
    return cap


def apply() -> None:
    from vllm.v1.spec_decode.dflash import DFlashProposer

    stock_init = DFlashProposer.__init__

    def __init__(self, vllm_config, device, runner=None) -> None:
        stock_init(self, vllm_config, device, runner)
        grow_query_buffers(self)

    replace_attr(DFlashProposer, "__init__", __init__, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.BACKPORT,
    targets=("vllm.v1.spec_decode.dflash:DFlashProposer.__init__",),
    summary="DFlash query buffers hold a CUDA-graph-padded drafter batch.",
    why="Buffers of max_num_seqs*(1+k) tokens are sliced at the next capture size "
    "(e.g. max_num_seqs=33, k=3: 132 -> 136): short tensors, start-up/step failure.",
    upstream="vllm-project/vllm#50065",
    versions=V020,
    platforms=("cuda", "rocm"),
    probe=probe,
    apply=apply,
    future="Delete once the lowest supported vLLM has #50065 (after 0.23.0).",
    probe_false_reason="DFlashProposer.__init__ already sizes buffers by the capture size",
)
