# SPDX-License-Identifier: Apache-2.0
"""A prefill of exactly 1 + k tokens per request is not a speculative decode step.

``GPUModelRunner._is_uniform_decode`` classifies a batch by its shape only: every
request scheduled ``uniform_decode_query_len`` (= 1 + num_speculative_tokens)
tokens. A *prefill* of that shape (a prompt of k + 1 tokens, or the last chunk of a
longer one, alone or next to such decodes) is then dispatched to the FULL CUDA graph
captured for speculative verification. On hybrid targets (Gated-DeltaNet layers:
Qwen3.5/3.6) that graph replays the verify kernels with the GDN metadata of an
earlier decode step, so the request's recurrent state is never built from its
prompt: its first token and everything after are wrong. Measured on an H200 (vLLM
0.20.1, tiny Qwen3.5-architecture hybrid, DFlash k=7, CUDA graphs): the 8-token
prompt's first token was the float64 target's 0.55-of-the-logit-range loser.
Upstream: vllm-project/vllm#49918 and #53051 (open), fixes #47123 and #53059 (open).

Fix: the runner remembers, per ``execute_model``, how many requests of the batch
have draft tokens scheduled (``len(scheduled_spec_decode_tokens)``, no per-token
work, no device sync); when that is fewer than the batch's requests, the batch has
a prefill (or undrafted) row and is classified as mixed (``force_uniform_decode
= False``). Only for DFlash engines: other speculative methods keep vLLM's
behaviour (they have the same defect).
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np

from vllm_dflash.registry import V020, Patch, PatchKind, original, replace_attr
from vllm_dflash.spec_decode import uses_dflash

NAME = "dflash_prefill_not_uniform_decode"
# Requests of the current execute_model batch that have draft tokens scheduled
# (None outside execute_model: dummy runs and graph capture decide for themselves).
_SPEC_ROWS = "_vllm_dflash_spec_rows"


class _Stop(Exception):
    pass


def _fake_runner(spec_rows: int | None, query_len: int, record: list[bool]):
    """The parts of a GPUModelRunner that ``_determine_batch_execution_and_padding``
    reads before it dispatches, with a dispatcher that records ``uniform_decode``."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def dispatch(num_tokens, has_lora, uniform_decode, **_):
        record.append(bool(uniform_decode))
        raise _Stop

    fake = SimpleNamespace(
        _is_uniform_decode=GPUModelRunner._is_uniform_decode,
        uniform_decode_query_len=query_len,
        model_config=SimpleNamespace(is_encoder_decoder=False),
        input_batch=SimpleNamespace(
            lora_id_to_lora_request={},
            num_reqs=1,
            num_computed_tokens_cpu=np.zeros(1, dtype=np.int32),
            num_prompt_tokens=np.full(1, query_len, dtype=np.int32),
        ),
        _pad_for_sequence_parallelism=lambda n: n,
        cudagraph_dispatcher=SimpleNamespace(dispatch=dispatch),
        speculative_config=SimpleNamespace(method="dflash"),
    )
    setattr(fake, _SPEC_ROWS, spec_rows)
    return fake


def classify(determine, spec_rows: int | None, query_len: int = 8) -> bool:
    """``uniform_decode`` as ``determine`` (vLLM's method, stock or patched) decides
    it for one request prefilling ``query_len`` tokens = 1 + k."""
    record: list[bool] = []
    fake = _fake_runner(spec_rows, query_len, record)
    with contextlib.suppress(_Stop):
        determine(
            fake,
            num_tokens=query_len,
            num_reqs=1,
            num_scheduled_tokens_np=np.array([query_len], dtype=np.int32),
            max_num_scheduled_tokens=query_len,
            use_cascade_attn=False,
        )
    if not record:
        raise RuntimeError("_determine_batch_execution_and_padding never dispatched")
    return record[0]


def probe() -> bool:
    """Ask vLLM's own ``_determine_batch_execution_and_padding`` how it classifies a
    fresh request prefilling 1 + k tokens (no drafts scheduled): uniform decode is
    the defect."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return classify(original(GPUModelRunner._determine_batch_execution_and_padding), 0)


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # the current methods: a patch applied before this one stays in the chain
    stock_execute = GPUModelRunner.execute_model
    stock_determine = GPUModelRunner._determine_batch_execution_and_padding

    def execute_model(self, scheduler_output, *args, **kwargs):
        if not uses_dflash(self):
            return stock_execute(self, scheduler_output, *args, **kwargs)
        setattr(self, _SPEC_ROWS, len(scheduler_output.scheduled_spec_decode_tokens))
        try:
            return stock_execute(self, scheduler_output, *args, **kwargs)
        finally:
            setattr(self, _SPEC_ROWS, None)

    def _determine_batch_execution_and_padding(
        self, num_tokens: int, num_reqs: int, *args, **kwargs
    ):
        spec_rows = getattr(self, _SPEC_ROWS, None)
        if (
            spec_rows is not None
            and spec_rows < num_reqs
            and kwargs.get("force_uniform_decode") is None
            and len(args) < 6  # force_uniform_decode not passed by position
        ):
            kwargs["force_uniform_decode"] = False
        return stock_determine(self, num_tokens, num_reqs, *args, **kwargs)

    replace_attr(GPUModelRunner, "execute_model", execute_model, NAME)
    replace_attr(
        GPUModelRunner,
        "_determine_batch_execution_and_padding",
        _determine_batch_execution_and_padding,
        NAME,
    )


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FIX,
    targets=(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._determine_batch_execution_and_padding",
    ),
    summary="A prefill of 1+k tokens per request no longer replays the speculative-"
    "verify FULL CUDA graph (DFlash engines).",
    why="Shape-only uniform-decode check: on GDN hybrids (Qwen3.5/3.6) such a prefill "
    "skips the recurrent-state build and the request's output is wrong from token 1.",
    upstream="vllm-project/vllm#47123, #53059 (open; issues #49918, #53051)",
    versions=V020,
    platforms=("cuda", "rocm"),
    probe=probe,
    apply=apply,
    future="Delete when _is_uniform_decode also requires scheduled drafts on every "
    "request (the probe then answers not needed).",
    probe_false_reason="vLLM no longer classifies a 1+k-token prefill as uniform decode",
)
