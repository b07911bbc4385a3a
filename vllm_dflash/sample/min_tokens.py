# SPDX-License-Identifier: Apache-2.0
"""``min_tokens`` in DFlash steps: a stop token is masked where, and only where,
the request has fewer than ``min_tokens`` output tokens before it.

vLLM 0.20.x's ``MinTokensLogitsProcessor`` decides from the host length of the
request's output-token list. In a speculative step that goes wrong twice:

* The bonus row (the token after the step's last draft) goes through the plain
  ``apply``, which masks every request still below ``min_tokens`` before the step:
  a bonus token at output position ``len + n_drafts >= min_tokens`` cannot be EOS,
  although it can without speculation. Synchronous and asynchronous scheduling.
* With asynchronous scheduling the host list also holds the optimistic
  placeholders of the previous step's drafts (all assumed accepted). After a
  rejection it is too long by the rejected count: the draft rows are masked from
  a too-high start (EOS passes below ``min_tokens``), and the request leaves the
  processor before it reaches ``min_tokens``.

Either way greedy output differs from the same server without speculation (seen on
an H100 on 2026-12-07: ``min_tokens: 20`` on the tiny hybrid pair).

The patch takes each row's output position from the step's sequence lengths on the
device, which vLLM's runner already corrects for the previous step's acceptance
(``GPUModelRunner.seq_lens``): a row that predicts output token ``o`` gets the
request's stop tokens at ``-inf`` iff ``o < min_tokens``. For request ``r`` with
``n`` drafts: draft row ``j`` predicts ``o = seq_len - n + j - prompt_len`` and the
bonus (or plain) row ``o = seq_len - prompt_len``. The comparison runs on the
device (``torch.where``): no host sync. The (request, stop token) pairs are built on
the host when the batch changes, as vLLM builds them; a request keeps its pairs
until it leaves the batch (the device decides when its mask stops).

Only in processes that run DFlash (``registry.dflash_in_use()``); elsewhere vLLM's
code runs unchanged.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from vllm_dflash.registry import (
    ALL_PLATFORMS,
    V020,
    Patch,
    PatchKind,
    code_reads,
    dflash_in_use,
    original,
    replace_attr,
)
from vllm_dflash.spec_decode import uses_dflash

NAME = "dflash_min_tokens_positions"
_PROC = "vllm.v1.sample.logits_processor.builtin:MinTokensLogitsProcessor"
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner._update_states"
_ENTRIES = "_vllm_dflash_min_tokens"  # batch index -> (min_tokens, stop token ids)
_PAIRS = "_vllm_dflash_min_pairs"  # device/host pair arrays; None: rebuild
_STEP = "_vllm_dflash_min_step"  # (seq_lens tensor, num_prompt_tokens array)
_ATTACHED = "_vllm_dflash_min_tokens_batch"  # the runner's input batch last attached


def _entry(
    params: Any, prompt_tok_ids: list[int] | None, output_tok_ids: list[int]
) -> tuple[int, tuple[int, ...]] | None:
    stops = params.all_stop_token_ids
    if not params.min_tokens or not stops:
        return None
    return int(params.min_tokens), tuple(sorted(stops))


def update_state(proc: Any, batch_update: Any) -> None:
    """Track (min_tokens, stop ids) per batch index; no length-based removal."""
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates

    entries = proc.__dict__.setdefault(_ENTRIES, {})
    if process_dict_updates(entries, batch_update, _entry):
        proc.__dict__[_PAIRS] = None


def _pairs(proc: Any) -> tuple[Any, ...] | None:
    """(req, tok, lim) on the device and (req, lim) on the host, one element per
    (request, stop token); ``lim = prompt_len + min_tokens``."""
    entries = proc.__dict__.get(_ENTRIES)
    if not entries:
        return None
    pairs = proc.__dict__.get(_PAIRS)
    if pairs is None:
        step = proc.__dict__.get(_STEP)
        if step is None:
            raise RuntimeError(
                f"{NAME}: min_tokens requests but no step lengths (the model "
                "runner's _update_states wrapper did not run)"
            )
        prompt = step[1]
        req, tok, lim = [], [], []
        for i, (min_tokens, stops) in sorted(entries.items()):
            for t in stops:
                req.append(i)
                tok.append(t)
                lim.append(int(prompt[i]) + min_tokens)
        req_np, lim_np = np.array(req, np.int64), np.array(lim, np.int64)
        pairs = (
            _device(proc, req_np),
            _device(proc, np.array(tok, np.int64)),
            _device(proc, lim_np),
            req_np,
            lim_np,
        )
        proc.__dict__[_PAIRS] = pairs
    return pairs


def _device(proc: Any, data: np.ndarray) -> torch.Tensor:
    host = torch.from_numpy(data)
    if proc.pin_memory:
        host = host.pin_memory()
    return host.to(proc.device, non_blocking=True)


def _mask(
    logits: torch.Tensor,
    rows: torch.Tensor,
    toks: torch.Tensor,
    seq_lens: torch.Tensor,
    below: torch.Tensor,
) -> None:
    """``logits[rows, toks] = -inf`` where ``seq_lens < below`` (on the device)."""
    masked = seq_lens.to(torch.int64) < below
    vals = logits[rows, toks]
    logits[rows, toks] = torch.where(masked, torch.full_like(vals, -float("inf")), vals)


def apply_rows(proc: Any, logits: torch.Tensor) -> torch.Tensor:
    """One row per request (plain sampling, or a speculative step's bonus rows)."""
    pairs = _pairs(proc)
    if pairs is None:
        return logits
    req, tok, lim = pairs[:3]
    seq_lens = proc.__dict__[_STEP][0]
    _mask(logits, req, tok, seq_lens[req], lim)
    return logits


def apply_draft_rows(
    proc: Any, logits: torch.Tensor, num_draft_tokens: list[int]
) -> torch.Tensor:
    """The draft rows of a speculative step (``num_draft_tokens[r]`` rows of request
    ``r``, in batch order): row ``j`` of ``r`` is masked iff
    ``seq_len[r] < lim + n_r - j``."""
    pairs = _pairs(proc)
    if pairs is None:
        return logits
    req_d, tok_d, _, req_h, lim_h = pairs
    n = np.asarray(num_draft_tokens, dtype=np.int64)
    first = np.cumsum(n) - n  # each request's first draft row
    counts = n[req_h]  # draft rows of each pair's request
    if not counts.any():
        return logits
    pair = np.repeat(np.arange(len(req_h)), counts)
    j = np.arange(len(pair)) - np.repeat(np.cumsum(counts) - counts, counts)
    rows = first[req_h][pair] + j
    below = lim_h[pair] + counts[pair] - j
    pair_d, rows_d, below_d = _device(proc, np.stack([pair, rows, below]))  # one copy
    seq_lens = proc.__dict__[_STEP][0]
    _mask(logits, rows_d, tok_d[pair_d], seq_lens[req_d[pair_d]], below_d)
    return logits


def attach(runner: Any) -> None:
    """Give the batch's min-tokens processor the runner's sequence lengths (a
    persistent device buffer) and prompt lengths (host array)."""
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor

    batch = runner.input_batch
    for proc in batch.logitsprocs.non_argmax_invariant:
        if isinstance(proc, MinTokensLogitsProcessor):
            step = proc.__dict__.get(_STEP)
            if step is None or step[0] is not runner.seq_lens:
                proc.__dict__[_STEP] = (runner.seq_lens, batch.num_prompt_tokens)
                proc.__dict__[_PAIRS] = None


def probe() -> bool:
    """Does the stock processor mask a bonus row by the request's length before
    the step (it cannot know the step's drafts)?"""
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    spec = inspect.signature(original(MinTokensLogitsProcessor.apply_with_spec_decode))
    if list(spec.parameters) != ["self", "logits", "num_draft_tokens"]:
        return False  # the spec-decode path takes more than draft counts now
    if not code_reads(RejectionSampler.forward, "predict_bonus_token"):
        return False  # the bonus row no longer goes through the plain sampler
    proc = MinTokensLogitsProcessor(None, torch.device("cpu"), False)
    params = SimpleNamespace(min_tokens=3, all_stop_token_ids={1})
    added = [(0, params, [5, 6], [7])]  # one output token so far
    original(MinTokensLogitsProcessor.update_state)(
        proc, SimpleNamespace(added=added, removed=[], moved=[])
    )
    # The bonus row of a step that verified 4 drafts predicts output token 5 >= 3.
    if hasattr(proc, "set_step_lengths"):  # a vLLM that takes the step's lengths
        proc.set_step_lengths(torch.tensor([2 + 1 + 4]), np.array([2]))
    bonus = torch.zeros(1, 4)
    original(MinTokensLogitsProcessor.apply)(proc, bonus)
    return bool(torch.isinf(bonus[0, 1]))


def apply() -> None:
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    stock_update = MinTokensLogitsProcessor.update_state
    stock_apply = MinTokensLogitsProcessor.apply
    stock_spec = MinTokensLogitsProcessor.apply_with_spec_decode

    def update_state_(self, batch_update):
        if not dflash_in_use():
            return stock_update(self, batch_update)
        return update_state(self, batch_update)

    def apply_(self, logits):
        if not dflash_in_use():
            return stock_apply(self, logits)
        return apply_rows(self, logits)

    def apply_with_spec_decode_(self, logits, num_draft_tokens):
        if not dflash_in_use():
            return stock_spec(self, logits, num_draft_tokens)
        return apply_draft_rows(self, logits, num_draft_tokens)

    stock_states = GPUModelRunner._update_states

    def _update_states(self, *args, **kwargs):
        out = stock_states(self, *args, **kwargs)
        # once per input batch (vLLM may build a new one after the KV cache)
        if self.__dict__.get(_ATTACHED) is not self.input_batch:
            if uses_dflash(self):
                attach(self)
            self.__dict__[_ATTACHED] = self.input_batch
        return out

    replace_attr(MinTokensLogitsProcessor, "update_state", update_state_, NAME)
    replace_attr(MinTokensLogitsProcessor, "apply", apply_, NAME)
    replace_attr(
        MinTokensLogitsProcessor,
        "apply_with_spec_decode",
        apply_with_spec_decode_,
        NAME,
    )
    replace_attr(GPUModelRunner, "_update_states", _update_states, NAME)


PATCH = Patch(
    name=NAME,
    kind=PatchKind.FIX,
    targets=(
        f"{_PROC}.update_state",
        f"{_PROC}.apply",
        f"{_PROC}.apply_with_spec_decode",
        _RUNNER,
    ),
    summary="DFlash: min_tokens masks stop tokens at the rows whose output position "
    "is below min_tokens, from the step's device-side sequence lengths (draft and "
    "bonus rows, synchronous and asynchronous scheduling).",
    why="vLLM masks from the host output length: the bonus row after accepted drafts "
    "is masked past min_tokens, and with async scheduling the optimistic "
    "placeholders of rejected drafts shift the draft rows' mask, so EOS can be "
    "chosen before min_tokens; greedy output then differs from no speculation.",
    upstream="none found (vLLM's MinTokensLogitsProcessor.apply_with_spec_decode "
    "counts the host output list; the bonus row uses apply)",
    versions=V020,
    platforms=ALL_PLATFORMS,
    probe=probe,
    apply=apply,
    future="Drop when vLLM's min-tokens processor takes row positions in "
    "speculative steps; the probe then reports it not needed.",
    probe_false_reason="the min-tokens processor no longer masks the bonus row by "
    "the request's length before the step",
    trigger="vllm.v1.worker.gpu_model_runner",
)
