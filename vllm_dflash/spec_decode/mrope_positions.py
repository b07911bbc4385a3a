# SPDX-License-Identifier: Apache-2.0
"""DFlash on M-RoPE targets (Qwen3.5/3.6 VL): the drafter gets token-index positions.

``DFlashProposer.set_inputs_first_pass`` (0.20.x) hands the target's positions
to the input-expansion kernel, which uses them both for the drafter's RoPE and
for the drafter's KV-cache slot mapping (``block_table[pos // B] * B + pos % B``).
For an M-RoPE target those positions are ``(3, N)``; the kernel reads row 0.
For text row 0 equals the token index, but after an image it is smaller (an
image of ``t x h x w`` merged patches advances the M-RoPE position by
``max(t, h, w)``, not by its token count), so the context K/V of every token
after an image is written into the slots of earlier tokens and the query block
lands in the wrong slots: the draft attends to the wrong keys.

Choice: the drafter is a text model with 1-D RoPE and gets the token index for
RoPE and slots alike. z-lab's reference (``dflash/model.py:dflash_generate``)
runs the drafter with ``position_ids = arange(sequence length)``; SGLang's
``dflash_worker.py`` uses the token index for the context keys and the query
block of any target; TensorRT-LLM (#13782) uses M-RoPE row 0 for the prompt's
context keys but the token index for later keys and the query block. For
text-only prompts all agree. KV slots must follow the token index either way,
because the drafter's block table and sequence lengths count tokens
(docs/hybrid.md; tests/e2e/test_hybrid_images.py).
"""

from __future__ import annotations

import torch

from vllm_dflash.cpu.dflash_inputs import TRITON_SHIM
from vllm_dflash.registry import Patch, PatchKind, original, replace_attr

PATCH_NAME = "dflash_mrope_token_positions"


def token_positions(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Token index of each scheduled token: ``seq_len - query_len + offset``."""
    qsl = query_start_loc.long()
    q_len = qsl[1:] - qsl[:-1]
    start = seq_lens.long() - q_len  # tokens computed before this step
    req = torch.repeat_interleave(
        torch.arange(q_len.numel(), device=qsl.device), q_len, output_size=num_tokens
    )
    idx = torch.arange(num_tokens, device=qsl.device)
    return start[req] + idx - qsl[req]


def kernel_positions(method, positions: torch.Tensor) -> torch.Tensor:
    """Run a ``set_inputs_first_pass`` (stock or patched) for one request of
    ``positions.shape[-1]`` new tokens after 6 computed ones, up to the
    input-expansion kernel launch; return the positions the kernel receives."""
    from vllm.v1.spec_decode import dflash

    n = positions.shape[-1]
    seen: dict[str, torch.Tensor] = {}

    class _Stop(Exception):
        pass

    class _Kernel:
        def __getitem__(self, grid):
            def launch(**kw):
                seen["pos"] = kw["target_positions_ptr"].clone()
                raise _Stop

            return launch

    class _Cad:
        max_query_len = n
        query_start_loc = torch.tensor([0, n], dtype=torch.int32)
        seq_lens = torch.tensor([n + 6], dtype=torch.int32)
        block_table_tensor = torch.zeros(1, 4, dtype=torch.int32)

        @staticmethod
        def batch_size() -> int:
            return 1

    class _Fake(dflash.DFlashProposer):
        def __getattr__(self, name: str):  # buffers the launch arguments name
            return None

    fake = object.__new__(_Fake)
    fake.num_speculative_tokens = 1
    fake.device = torch.device("cpu")
    saved = dflash.copy_and_expand_dflash_inputs_kernel, dflash.triton
    dflash.copy_and_expand_dflash_inputs_kernel = _Kernel()
    if not hasattr(dflash.triton, "next_power_of_2"):  # no Triton driver (CPU)
        dflash.triton = TRITON_SHIM
    try:
        method(
            fake, torch.zeros(n, dtype=torch.long), torch.zeros(1, dtype=torch.long),
            positions, torch.zeros(n, 4), None, _Cad(), None,
        )  # fmt: skip
    except _Stop:
        pass
    finally:
        dflash.copy_and_expand_dflash_inputs_kernel, dflash.triton = saved
    return seen["pos"]


def probe() -> bool:
    """Does the proposer hand a 2-D (M-RoPE) position tensor to the kernel?"""
    from vllm.v1.spec_decode import dflash

    stock = original(dflash.DFlashProposer.set_inputs_first_pass)
    return kernel_positions(stock, torch.zeros(3, 2, dtype=torch.long)).dim() == 2


def apply() -> None:
    from vllm.v1.spec_decode import dflash

    stock = dflash.DFlashProposer.set_inputs_first_pass

    def set_inputs_first_pass(
        self,
        target_token_ids: torch.Tensor,
        next_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        cad,
        num_rejected_tokens_gpu: torch.Tensor | None,
    ):
        if target_positions.dim() == 2:
            target_positions = token_positions(
                cad.query_start_loc, cad.seq_lens, target_token_ids.shape[0]
            )
        return stock(
            self, target_token_ids, next_token_ids, target_positions,
            target_hidden_states, token_indices_to_sample, cad, num_rejected_tokens_gpu,
        )  # fmt: skip

    replace_attr(
        dflash.DFlashProposer,
        "set_inputs_first_pass",
        set_inputs_first_pass,
        PATCH_NAME,
    )


PATCH = Patch(
    name=PATCH_NAME,
    kind=PatchKind.FIX,
    targets=("vllm.v1.spec_decode.dflash:DFlashProposer.set_inputs_first_pass",),
    summary="DFlash drafter positions and KV slots follow the token index on M-RoPE targets.",
    why="0.20.x passes M-RoPE row 0 to the drafter: after an image it is smaller than "
    "the token index, so draft context K/V land in wrong KV slots (Qwen3.5/3.6 VL).",
    upstream="none (vLLM 0.20.x DFlash + M-RoPE)",
    # 0.20.0-0.20.2 share this proposer; 0.21.0 changed it (not verified there).
    versions=">=0.20.0,<0.21.0",
    platforms=("cuda", "cpu", "rocm"),
    probe=probe,
    apply=apply,
    future="Upstream: pass token positions (not mrope_positions) to the DFlash proposer.",
    probe_false_reason="the proposer already passes 1-D positions to the kernel",
)
