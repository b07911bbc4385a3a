# SPDX-License-Identifier: Apache-2.0
"""CPU defect 3: the CPU rejection-sampler fallbacks miss the synthetic arguments.

vLLM 0.20 added ``uniform_probs``/``synthetic_conditional_rates``/``SYNTHETIC_MODE``
to the Triton rejection kernels; ``vllm.utils.cpu_triton_utils`` still has the
old signatures (TypeError at the first verification step). Fixed upstream in
0.21.0. ``CPUModelRunner.__init__`` re-installs these fallbacks from
``cpu_triton_utils``, so that module is what we patch.

Synthetic acceptance (``rejection_sample_method: synthetic``, a GPU benchmarking
feature) is refused with a clear error on CPU.
"""

import inspect

import torch

from vllm_dflash.registry import (
    CPU_ONLY,
    V020,
    Patch,
    PatchKind,
    original,
    replace_attr,
)

NAME = "cpu_rejection_sampler_args"
_SYNTHETIC_MSG = (
    "speculative_config rejection_sample_method='synthetic' is not supported on "
    "the CPU backend (vllm-dflash); use the default rejection sampler on CPU."
)


def probe() -> bool:
    from vllm.utils import cpu_triton_utils as cpu_tl

    params = inspect.signature(original(cpu_tl.rejection_greedy_sample_kernel.func))
    return "SYNTHETIC_MODE" not in params.parameters


def apply() -> None:
    from vllm.utils import cpu_triton_utils as cpu_tl

    stock_greedy = original(cpu_tl.rejection_greedy_sample_kernel.func)
    stock_random = original(cpu_tl.rejection_random_sample_kernel.func)

    def greedy(
        output_token_ids,
        cu_num_draft_tokens,
        draft_token_ids,
        target_argmax,
        bonus_token_ids,
        is_greedy,
        max_spec_len,
        uniform_probs=None,
        synthetic_conditional_rates=None,
        SYNTHETIC_MODE=False,
    ):
        if SYNTHETIC_MODE:
            raise NotImplementedError(_SYNTHETIC_MSG)
        stock_greedy(
            output_token_ids,
            cu_num_draft_tokens,
            draft_token_ids,
            target_argmax,
            bonus_token_ids,
            is_greedy,
            max_spec_len,
        )

    def random(
        output_token_ids,
        cu_num_draft_tokens,
        draft_token_ids,
        draft_probs,
        target_probs,
        bonus_token_ids,
        recovered_token_ids,
        uniform_probs,
        is_greedy,
        max_spec_len,
        vocab_size,
        synthetic_conditional_rates=None,
        NO_DRAFT_PROBS=False,
        SYNTHETIC_MODE=False,
    ):
        if SYNTHETIC_MODE:
            raise NotImplementedError(_SYNTHETIC_MSG)
        stock_random(
            output_token_ids,
            cu_num_draft_tokens,
            draft_token_ids,
            draft_probs,
            target_probs,
            bonus_token_ids,
            recovered_token_ids,
            uniform_probs,
            is_greedy,
            max_spec_len,
            vocab_size,
            NO_DRAFT_PROBS=NO_DRAFT_PROBS,
        )

    for attr, fn in (
        ("rejection_greedy_sample_kernel", greedy),
        ("rejection_random_sample_kernel", random),
    ):
        fn.__wrapped_original__ = getattr(cpu_tl, attr).func
        replace_attr(cpu_tl, attr, cpu_tl._FuncWrapper(fn), NAME)


RECOVERED_NAME = "cpu_recovered_tokens_args"


def recovered_probe() -> bool:
    """vLLM 0.23 passes USE_FP64_GUMBEL to sample_recovered_tokens_kernel; its
    CPU fallback does not take it (TypeError in the profile run)."""
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.utils import cpu_triton_utils as cpu_tl

    caller = inspect.getsource(rs.sample_recovered_tokens)
    params = inspect.signature(original(cpu_tl.sample_recovered_tokens_kernel.func))
    return "USE_FP64_GUMBEL" in caller and "USE_FP64_GUMBEL" not in params.parameters


def recovered_apply() -> None:
    from vllm.utils import cpu_triton_utils as cpu_tl

    stock = original(cpu_tl.sample_recovered_tokens_kernel.func)

    def sample_recovered(*args, USE_FP64_GUMBEL=False, **kwargs):  # noqa: N803
        # The CPU kernel computes the exponential race in float32 only; the flag is
        # a precision choice of the GPU kernel, not a different distribution. With
        # it, the caller draws the noise in float64 (inv_q): the C++ kernel takes
        # float32 ("expected scalar type Float but found Double"), so cast it.
        # tests/unit/test_rejection_sampling_dist.py checks the distribution.
        args = list(args)
        if len(args) > 5 and args[5].dtype != torch.float32:
            args[5] = args[5].to(torch.float32)
        if "inv_q" in kwargs and kwargs["inv_q"].dtype != torch.float32:
            kwargs["inv_q"] = kwargs["inv_q"].to(torch.float32)
        stock(*args, **kwargs)

    sample_recovered.__wrapped_original__ = cpu_tl.sample_recovered_tokens_kernel.func
    replace_attr(
        cpu_tl,
        "sample_recovered_tokens_kernel",
        cpu_tl._FuncWrapper(sample_recovered),
        RECOVERED_NAME,
    )


PATCH = Patch(
    name=NAME,
    kind=PatchKind.CPU,
    targets=(
        "vllm.utils.cpu_triton_utils:rejection_greedy_sample_kernel",
        "vllm.utils.cpu_triton_utils:rejection_random_sample_kernel",
    ),
    summary="CPU rejection-sampler fallbacks accept the synthetic-mode arguments.",
    why="TypeError at the first verification step of any speculative method on CPU.",
    upstream="fixed upstream in 0.21.0",
    versions=V020,
    platforms=CPU_ONLY,
    probe=probe,
    apply=apply,
    future="Drop with 0.20.x support; the probe already skips it from 0.21.0.",
)

RECOVERED_PATCH = Patch(
    name=RECOVERED_NAME,
    kind=PatchKind.CPU,
    targets=("vllm.utils.cpu_triton_utils:sample_recovered_tokens_kernel",),
    summary="CPU recovered-token sampler fallback accepts USE_FP64_GUMBEL.",
    why="vLLM 0.23.0 passes USE_FP64_GUMBEL; the CPU fallback raises TypeError "
    "in the profile run of any speculative method.",
    upstream="none, CPU backend defect (new in 0.23.0)",
    versions=V020,
    platforms=CPU_ONLY,
    probe=recovered_probe,
    apply=recovered_apply,
    future="Upstream: add USE_FP64_GUMBEL to the CPU fallback signature.",
    probe_false_reason="this vLLM's rejection sampler does not pass USE_FP64_GUMBEL",
)
