# SPDX-License-Identifier: Apache-2.0
"""Full CUDA graphs for decode batches that verify fewer than k drafts (opt-in).

vLLM 0.20-0.23 captures the target's full decode graphs for one query length
only, ``1 + num_speculative_tokens`` (the runner's and the dispatcher's
``uniform_decode_query_len``). An adaptive DFlash engine
(``"draft_length": "adaptive"``) also verifies shorter blocks; a batch whose
decodes all verify ``d < k`` drafts is then not a "uniform decode" and replays
the piecewise graph, with every attention and Gated-DeltaNet layer run from
Python between the pieces. On the H200 a 0-draft step of the Qwen3.6-27B-shaped
pair at 256 requests took 48.2 ms against 38.5 ms for a no-speculation decode
step. With this patch it took 48.0 ms (``benchmarks/results/h200-2026-12-03-s21``):
at that size the step is GPU-bound and the graph is not the cost. The patch stays
opt-in for smaller, host-bound batches, where that is still unmeasured.

With ``VLLM_DFLASH_SHORT_VERIFY_GRAPHS=0,1,3`` (draft lengths) an adaptive DFlash
engine with full decode graphs also captures full graphs for uniform batches of
``q = 1 + d`` tokens per request, for each listed ``d`` whose ``q`` divides every
capture size (vLLM rounds them to multiples of ``1 + k``: at k = 15, d = 0, 1, 3
and 7 qualify). Three changes, all keyed on the runner:

* keys: after vLLM initialises the dispatcher's keys, add FULL
  ``BatchDescriptor(s, s // q, uniform=True)`` for every capture size
  ``q <= s <= q * max_num_seqs`` (unique: ``num_reqs`` differs per ``q``);
* run: a step whose requests all have draft lists (counted per step by
  ``dflash_prefill_not_uniform_decode``, required) and are all speculative
  decodes (the runner's ``num_decode_draft_tokens`` >= 0, set by
  ``_prepare_inputs``) of exactly ``q`` tokens each, no more than ``q``'s
  largest key, is dispatched with ``q`` as the uniform query length, so it
  finds its FULL key (vLLM's own shape check does the rest). Beyond that size
  vLLM caps the padded ``num_reqs`` at ``max_num_seqs``, which can name another
  query length's key; a FULL result that is not ``q`` tokens per request is
  dispatched again the stock way;
* capture: such a descriptor is warmed up and captured with ``q`` as the query
  length, so ``_dummy_run`` builds its batch and attention metadata for ``q``.

The Gated-DeltaNet builder needs no change: ``dflash_gdn_zero_draft_decodes``
also applies at capture, so a ``q = 1`` graph records the speculative path that
0-draft steps take. Off for fixed-k engines (a ``q = 1`` capture would take the
non-speculative GDN path), LoRA, data parallelism and micro-batching.
Experimental. On the H200 it is lossless on the dense pair, with drafts matching the
reference. The first step dispatched to each extra length's graph is logged once;
GPU checks require that line (docs/full-graph-short-verifies.md).
"""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator, Sequence
from typing import Any

from vllm_dflash import envs
from vllm_dflash.config import draft_length
from vllm_dflash.logger import init_logger
from vllm_dflash.registry import (
    V020,
    Patch,
    PatchKind,
    PatchState,
    code_reads,
    is_patched,
    original,
    replace_attr,
)
from vllm_dflash.spec_decode import prefill_alias, uses_dflash

logger = init_logger(__name__)

NAME = "dflash_short_verify_full_graphs"
# On a runner: the extra uniform query lengths that have FULL keys (set when the
# dispatcher's keys are initialised; absent or empty: the feature is off there).
_QUERY_LENS = "_vllm_dflash_short_verify_query_lens"
# On a runner: the extra query lengths whose first full-graph replay was logged.
_REPLAYED = "_vllm_dflash_short_verify_replayed"
# Set per execute_model by dflash_prefill_not_uniform_decode: requests of the step
# that have a draft list (possibly empty); this patch needs it (off_reason).
_SPEC_ROWS = prefill_alias._SPEC_ROWS


def usable_lengths(
    requested: Sequence[int], k: int, capture_sizes: Sequence[int]
) -> tuple[list[int], list[int]]:
    """(draft lengths that can have full graphs, the requested ones that cannot):
    ``d < k`` whose ``1 + d`` divides every capture size (vLLM pads a uniform
    batch to a capture size and asserts it holds whole requests)."""
    usable, rejected = [], []
    for d in sorted(set(requested)):
        q = 1 + d
        ok = (
            0 <= d < k
            and bool(capture_sizes)
            and all(s % q == 0 for s in capture_sizes)
        )
        (usable if ok else rejected).append(d)
    return usable, rejected


def rounded_capture_sizes(
    sizes: Sequence[int], k: int, max_size: int, multiple_of: int = 0
) -> list[int]:
    """The capture sizes a worker of a speculative engine with full decode graphs
    uses: vLLM rounds them up to multiples of ``1 + k`` (of ``max(1 + k, tp)``
    with sequence parallelism: ``multiple_of``) within ``max_size``
    (``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode``)."""
    q = multiple_of or 1 + k
    rounded = sorted({-(-s // q) * q for s in sizes if -(-s // q) * q <= max_size})
    if not rounded and q <= max_size:
        rounded = [q]
    return rounded


def graph_tokens_by_length(vllm_config: Any, k: int) -> dict[int, int]:
    """Per extra draft length with full graphs in this engine: the largest batch,
    in tokens, that runs as one. For the scheduler's policy, which sees the
    configuration as the user gave it: the worker decides by the same rules, on
    the mode its attention backends allow (a backend without full graphs lowers
    it there, and these lengths then run piecewise, as the policy's k does)."""
    from vllm_dflash.compat import platform_name
    from vllm_dflash.core.adaptive_draft_length import full_graph_tokens

    if (
        not os.environ.get(envs.VLLM_DFLASH_SHORT_VERIFY_GRAPHS, "").strip()
        or {NAME, prefill_alias.NAME} & envs.disabled_patches()
        or platform_name() not in PATCH.platforms
        or draft_length.mode_of(vllm_config) != draft_length.ADAPTIVE
        or not full_graph_tokens(vllm_config)
        or _unsupported(vllm_config) is not None
    ):
        return {}
    compilation = vllm_config.compilation_config
    tp = vllm_config.parallel_config.tensor_parallel_size
    sp = tp > 1 and compilation.pass_config.enable_sp
    sizes = rounded_capture_sizes(
        compilation.cudagraph_capture_sizes or [],
        k,
        int(compilation.max_cudagraph_capture_size or 0),
        max(1 + k, tp) if sp else 0,
    )
    usable, _ = usable_lengths(envs.short_verify_graph_lengths(), k, sizes)
    max_num_seqs = vllm_config.scheduler_config.max_num_seqs
    out = {}
    for d in usable:
        fits = key_sizes(sizes, 1 + d, max_num_seqs)
        if fits:
            out[d] = max(fits)
    return out


def _unsupported(vllm_config: Any) -> str | None:
    """Why an engine cannot have the extra graphs (None: it can)."""
    parallel = vllm_config.parallel_config
    if getattr(parallel, "data_parallel_size", 1) > 1:
        return "data parallelism (ranks agree on one uniform query length)"
    if getattr(parallel, "use_ubatching", False):
        return "micro-batching"
    if vllm_config.lora_config is not None:
        return "LoRA"
    return None


def prefill_alias_applied() -> bool:
    """Whether dflash_prefill_not_uniform_decode wraps the runner's execute_model
    (it sets the per-step count of drafted rows this patch reads)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    f = GPUModelRunner.execute_model
    while f is not None:
        if is_patched(f, prefill_alias.NAME):
            return True
        f = getattr(f, "__wrapped_original__", None)
    return False


def off_reason(runner: Any) -> str | None:
    """Why this runner keeps vLLM's graphs only (None: it gets the extra ones)."""
    from vllm.config import CUDAGraphMode

    if not uses_dflash(runner):
        return "not a DFlash engine"
    if draft_length.mode_of(runner.vllm_config) != draft_length.ADAPTIVE:
        return 'speculative_config.draft_length is not "adaptive"'
    if not prefill_alias_applied():
        return f"{prefill_alias.NAME} is not applied (it counts the drafted rows)"
    mode = runner.cudagraph_dispatcher.cudagraph_mode
    if mode.decode_mode() != CUDAGraphMode.FULL or not mode.separate_routine():
        return f"cudagraph_mode {mode.name} has no separate full decode graphs"
    return _unsupported(runner.vllm_config)


def key_sizes(capture_sizes: Sequence[int], q: int, max_num_seqs: int) -> list[int]:
    """The capture sizes that get a FULL key for ``q`` tokens per request: whole
    requests, at most ``max_num_seqs`` of them (the worker's keys and the
    scheduler's view both follow this rule)."""
    return [s for s in capture_sizes if q <= s <= q * max_num_seqs]


def decode_descriptors(
    capture_sizes: Sequence[int], q: int, max_num_seqs: int
) -> list[Any]:
    """FULL keys for uniform batches of ``q`` tokens per request, as vLLM builds
    its own for ``1 + k`` (``CudagraphDispatcher._create_padded_batch_descriptor``
    with exact ``num_reqs``)."""
    from vllm.forward_context import BatchDescriptor

    return [
        BatchDescriptor(num_tokens=s, num_reqs=s // q, uniform=True)
        for s in key_sizes(capture_sizes, q, max_num_seqs)
    ]


def add_keys(runner: Any, lengths: Sequence[int]) -> dict[int, int]:
    """Add the FULL keys of ``lengths`` to the runner's dispatcher; returns, per
    query length that has keys, the largest batch (tokens) they cover."""
    from vllm.config import CUDAGraphMode

    dispatcher = runner.cudagraph_dispatcher
    sizes = list(runner.compilation_config.cudagraph_capture_sizes or [])
    usable, rejected = usable_lengths(lengths, runner.num_spec_tokens, sizes)
    max_num_seqs = runner.scheduler_config.max_num_seqs
    full = dispatcher.cudagraph_keys[CUDAGraphMode.FULL]
    taken = {(d.num_tokens, d.num_reqs) for d in full}
    limits: dict[int, int] = {}
    added = 0
    for d in usable:
        descs = decode_descriptors(sizes, 1 + d, max_num_seqs)
        if not descs:  # every capture size holds more than max_num_seqs rows
            rejected.append(d)
            continue
        for desc in descs:
            if (desc.num_tokens, desc.num_reqs) in taken and desc not in full:
                raise RuntimeError(f"full CUDA graph key {desc} collides with vLLM's")
            if desc not in full:
                dispatcher.add_cudagraph_key(CUDAGraphMode.FULL, desc)
                added += 1
        limits[1 + d] = max(desc.num_tokens for desc in descs)
    if rejected:
        logger.warning(
            "DFlash: %s=%s: no full CUDA graphs for draft lengths %s (need d < "
            "num_speculative_tokens=%d, 1 + d dividing every capture size %s, and "
            "a size of at most (1 + d) x max_num_seqs=%d)",
            envs.VLLM_DFLASH_SHORT_VERIFY_GRAPHS,
            ",".join(map(str, lengths)),
            sorted(rejected),
            runner.num_spec_tokens,
            sizes,
            max_num_seqs,
        )
    if added:
        logger.info(
            "DFlash: full CUDA graphs also for decodes verifying %s drafts "
            "(%d more graphs; %s)",
            [q - 1 for q in sorted(limits)],
            added,
            envs.VLLM_DFLASH_SHORT_VERIFY_GRAPHS,
        )
    return limits


@contextlib.contextmanager
def query_len(runner: Any, q: int) -> Iterator[None]:
    """vLLM's uniform decode query length set to ``q`` for one call."""
    dispatcher = runner.cudagraph_dispatcher
    saved = runner.uniform_decode_query_len, dispatcher.uniform_decode_query_len
    runner.uniform_decode_query_len = dispatcher.uniform_decode_query_len = q
    try:
        yield
    finally:
        runner.uniform_decode_query_len, dispatcher.uniform_decode_query_len = saved


def step_query_len(
    runner: Any, num_tokens: int, num_reqs: int, max_num_scheduled_tokens: int
) -> int | None:
    """The extra query length a real step runs as a full graph, if any: every
    row a speculative decode with a draft list (dflash_prefill_not_uniform_decode
    counts them per step; the runner's ``num_decode_draft_tokens`` >= 0: no
    prefill chunk) of exactly ``q`` tokens, and a batch no larger than ``q``'s
    largest key (beyond it vLLM caps the padded ``num_reqs`` at ``max_num_seqs``,
    which would name another query length's graph)."""
    limits = getattr(runner, _QUERY_LENS, None)
    q = max_num_scheduled_tokens
    if not limits or q not in limits or num_reqs <= 0 or num_tokens != q * num_reqs:
        return None
    if num_tokens > limits[q] or getattr(runner, _SPEC_ROWS, None) != num_reqs:
        return None
    if not (runner.num_decode_draft_tokens.np[:num_reqs] >= 0).all():
        return None
    return q


def _dispatched_as(desc: Any, q: int) -> bool:
    return (
        bool(desc.uniform)
        and desc.num_reqs is not None
        and (desc.num_tokens == q * desc.num_reqs)
    )


def note_first_replay(runner: Any, q: int, desc: Any) -> None:
    """Log the first step of each extra query length that dispatches to its full
    graph: the evidence (GPU checks grep it) that the graphs are replayed, not
    only captured. One set lookup per such step afterwards."""
    seen = runner.__dict__.setdefault(_REPLAYED, set())
    if q in seen:
        return
    seen.add(q)
    logger.info(
        "DFlash: first full CUDA graph replay of a decode verifying %d drafts "
        "(%d requests, %d tokens)",
        q - 1,
        desc.num_reqs,
        desc.num_tokens,
    )


def probe() -> bool:
    """Opt-in; vLLM must still key full decode graphs by one query length."""
    if not os.environ.get(envs.VLLM_DFLASH_SHORT_VERIFY_GRAPHS, "").strip():
        return False
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    for owner, name in (
        (CudagraphDispatcher._create_padded_batch_descriptor, "dispatcher padding"),
        (GPUModelRunner._dummy_run, "GPUModelRunner._dummy_run"),
        (GPUModelRunner._determine_batch_execution_and_padding, "batch dispatch"),
    ):
        # through decorators (_dummy_run is wrapped by torch.inference_mode)
        if not code_reads(inspect.unwrap(original(owner)), "uniform_decode_query_len"):
            raise RuntimeError(f"{name} no longer reads uniform_decode_query_len")
    return True


def apply() -> None:
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock_check = GPUModelRunner._check_and_update_cudagraph_mode
    stock_determine = GPUModelRunner._determine_batch_execution_and_padding
    stock_capture = GPUModelRunner._warmup_and_capture

    def _check_and_update_cudagraph_mode(self, *args, **kwargs):
        out = stock_check(self, *args, **kwargs)
        reason = off_reason(self)
        if reason is None:
            # read here, for adaptive engines only (their front end refused a
            # malformed value before loading weights: config/draft_length.py)
            lengths = envs.short_verify_graph_lengths()
            setattr(self, _QUERY_LENS, add_keys(self, lengths))
            return out
        if uses_dflash(self) and getattr(self, _QUERY_LENS, None) is None:
            logger.warning(
                "DFlash: %s is set but unused: %s",
                envs.VLLM_DFLASH_SHORT_VERIFY_GRAPHS,
                reason,
            )
        setattr(self, _QUERY_LENS, {})  # also after an earlier call that added keys
        return out

    def _determine_batch_execution_and_padding(
        self, num_tokens: int, num_reqs: int, *args, **kwargs
    ):
        if kwargs.get("force_uniform_decode") is None and len(args) < 6:
            max_tokens = kwargs.get(
                "max_num_scheduled_tokens", args[1] if len(args) > 1 else None
            )
            q = step_query_len(self, num_tokens, num_reqs, max_tokens or 0)
            if q is not None:
                with query_len(self, q):
                    out = stock_determine(self, num_tokens, num_reqs, *args, **kwargs)
                if out[0] != CUDAGraphMode.FULL:
                    return out
                if _dispatched_as(out[1], q):
                    note_first_replay(self, q, out[1])
                    return out
                # a FULL graph of another query length: never replay it
        return stock_determine(self, num_tokens, num_reqs, *args, **kwargs)

    def _warmup_and_capture(self, desc, *args, **kwargs):
        qs = getattr(self, _QUERY_LENS, None)
        if qs and desc.uniform and desc.num_reqs:
            q = desc.num_tokens // desc.num_reqs
            if q in qs and q * desc.num_reqs == desc.num_tokens:
                with query_len(self, q):
                    return stock_capture(self, desc, *args, **kwargs)
        return stock_capture(self, desc, *args, **kwargs)

    replace_attr(
        GPUModelRunner,
        "_check_and_update_cudagraph_mode",
        _check_and_update_cudagraph_mode,
        NAME,
    )
    replace_attr(
        GPUModelRunner,
        "_determine_batch_execution_and_padding",
        _determine_batch_execution_and_padding,
        NAME,
    )
    replace_attr(GPUModelRunner, "_warmup_and_capture", _warmup_and_capture, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FEATURE,
    targets=(
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._check_and_update_cudagraph_mode",
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._determine_batch_execution_and_padding",
        "vllm.v1.worker.gpu_model_runner:GPUModelRunner._warmup_and_capture",
    ),
    summary=(
        "VLLM_DFLASH_SHORT_VERIFY_GRAPHS=0,1,3 (experimental): adaptive DFlash "
        "engines also capture full CUDA graphs for decodes verifying those draft "
        "lengths."
    ),
    why=(
        "vLLM captures full decode graphs for 1 + k tokens per request only; shorter "
        "verifies replay the piecewise graph. H200, 27B hybrid, 256 requests: a "
        "0-draft step took 48.2 ms vs 38.5 ms for a no-spec decode, and 48.0 ms with "
        "this patch (GPU-bound there; smaller batches unmeasured)."
    ),
    upstream="none (vLLM keys full decode graphs by one uniform query length)",
    versions=V020,
    platforms=("cuda",),
    probe=probe,
    apply=apply,
    future="Default for adaptive engines once measured on the GPU; drop if vLLM "
    "captures decode graphs per query length.",
    when_probe_false=PatchState.NOT_APPLICABLE,
    probe_false_reason="VLLM_DFLASH_SHORT_VERIFY_GRAPHS is not set",
)
