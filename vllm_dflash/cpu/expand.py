# SPDX-License-Identifier: Apache-2.0
"""CPU defect: the rejection sampler's ``expand_kernel`` fallback drops float values.

``expand_batch_to_tokens`` expands per-request sampling parameters (temperature,
top_p, top_k) to one value per draft token before the target's verification
distribution is built. vLLM-CPU's fallback, ``cpu_triton_utils._expand_kernel_impl``,
converts ``output`` and ``input_val`` to int64 and lets the C++ op write into that
converted *copy*: for any non-int64 tensor (float32 temperature/top_p, int32 top_k)
the real output keeps the uninitialised memory of ``new_empty``. The target logits are
then divided by garbage, the target probabilities become inf/NaN, and the rejection
sampler accepts drafts it should reject: sampled (temperature > 0) speculative output
no longer follows the target's distribution (measured: total variation 0.93 instead
of 0.13 at the first verified token). Greedy requests are unaffected (no temperature).

The fix is a vectorised torch expansion that writes into ``output`` for every dtype.
``CPUModelRunner.__init__`` re-installs ``cpu_triton_utils.expand_kernel`` into
``vllm.v1.sample.rejection_sampler``, so the ``cpu_triton_utils`` attribute is what we
replace (and the sampler module's binding too, when it already points at the stock
fallback).
"""

from __future__ import annotations

import torch

from vllm_dflash.registry import Patch, PatchKind, original, replace_attr

PATCH_NAME = "cpu_expand_kernel_float"


def expand_kernel_impl(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: float,
    replace_to: float,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803  (Triton constexpr name)
) -> None:
    """``output[j] = input_val[i]`` for ``cu[i-1] <= j < cu[i]``, with
    ``replace_from`` mapped to ``replace_to``: the Triton ``expand_kernel``."""
    vals = torch.where(
        input_val == replace_from,
        torch.tensor(replace_to, dtype=input_val.dtype),
        input_val,
    )
    cu = cu_num_tokens.to(torch.int64)
    pos = torch.arange(output.shape[0], dtype=torch.int64, device=output.device)
    # Request of position j: the number of cumulative ends <= j.
    req = torch.searchsorted(cu, pos, right=True)
    valid = req < cu.shape[0]
    out = vals[req.clamp(max=cu.shape[0] - 1)].to(output.dtype)
    if bool(valid.all()):
        output.copy_(out)
    else:  # positions past the last request stay as they were (kernel semantics)
        output.copy_(torch.where(valid, out, output))


def _stock():
    import vllm._custom_ops  # noqa: F401  (registers torch.ops._C on CPU)
    from vllm.utils import cpu_triton_utils as cpu_tl

    return original(cpu_tl.expand_kernel.func)


def probe() -> bool:
    """Expand a float tensor with vLLM's own fallback and look at the result."""
    vals = torch.tensor([1.0, 0.7, 1.3], dtype=torch.float32)
    cu = torch.tensor([1, 3, 4], dtype=torch.int32)
    out = torch.full((4,), -7.0, dtype=torch.float32)
    _stock()(out, vals, cu, -1, 1)
    want = torch.tensor([1.0, 0.7, 0.7, 1.3], dtype=torch.float32)
    return not torch.equal(out, want)


def apply() -> None:
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.utils import cpu_triton_utils as cpu_tl

    stock_wrapper = cpu_tl.expand_kernel
    fixed = cpu_tl._FuncWrapper(expand_kernel_impl)
    expand_kernel_impl.__wrapped_original__ = original(stock_wrapper.func)
    replace_attr(cpu_tl, "expand_kernel", fixed, PATCH_NAME)
    if rs.expand_kernel is stock_wrapper:  # a CPU runner already installed it
        replace_attr(rs, "expand_kernel", fixed, PATCH_NAME)


PATCH = Patch(
    name=PATCH_NAME,
    kind=PatchKind.CPU,
    targets=("vllm.utils.cpu_triton_utils:expand_kernel",),
    summary="CPU expand_kernel fallback writes float/int32 values (temperature, top_p, top_k).",
    why=(
        "The stock fallback writes into an int64 copy: the verification uses "
        "uninitialised temperatures, so sampled speculative output is not the "
        "target's distribution (greedy is unaffected)."
    ),
    upstream="none, CPU backend defect (patches/v*/0010-cpu-expand-kernel-float.diff)",
    versions=">=0.20.0,<0.24.0",
    platforms=("cpu",),
    probe=probe,
    apply=apply,
    future="Send 0010-cpu-expand-kernel-float.diff upstream; the probe skips a fixed vLLM.",
)
