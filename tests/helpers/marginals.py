# SPDX-License-Identifier: Apache-2.0
"""Exact marginal distributions of the first sampled tokens, in float64.

For one prompt and one set of sampling parameters, the marginal of output token
``t`` is ``sum over prefixes (x_1..x_{t-1}) of P(prefix) * P(x_t | prompt, prefix)``,
where each conditional is the target's float64 softmax after vLLM's processing
order: penalties (repetition on prompt+output tokens, then frequency and presence
on output tokens), temperature, min-p, top-k, top-p. The prefix tree is expanded
level by level with the HF model's KV cache (one forward of the new token per
prefix); prefixes whose probability falls below ``prune`` (and beyond the
``max_prefixes`` most likely) are dropped and their total mass is returned, so a
test can bound what was left out (it is at most that mass in total variation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

DT = torch.float64


@dataclass(frozen=True)
class Params:
    """The subset of vLLM SamplingParams these marginals model."""

    temperature: float = 1.0
    top_k: int = 0  # 0 / -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def vllm_kwargs(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


@dataclass
class Marginals:
    probs: list[torch.Tensor]  # [n_tokens] x [V] float64
    pruned: list[float]  # probability mass left out at each position
    prefixes: list[int] = field(default_factory=list)  # prefixes expanded per level


def process(
    logits: torch.Tensor,  # [B, V] float64
    prompt: list[int],
    outputs: torch.Tensor,  # [B, t] output tokens so far
    p: Params,
) -> torch.Tensor:
    """Probabilities [B, V] after vLLM's logits processing (float64)."""
    x = logits.clone()
    B, V = x.shape
    counts = torch.zeros(B, V, dtype=DT)
    if outputs.shape[1]:
        counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=DT))
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        seen[:, torch.tensor(sorted(set(prompt)))] = True
        rp = p.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    x = x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(DT)
    x = x / p.temperature
    probs = x.softmax(-1)
    if p.min_p > 0:
        keep = probs >= p.min_p * probs.max(-1, keepdim=True).values
        x = x.masked_fill(~keep, -torch.inf)
    if p.top_k and p.top_k > 0:
        kth = x.topk(p.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -torch.inf)
    probs = x.softmax(-1)
    if p.top_p < 1.0:
        sp, idx = probs.sort(-1, descending=True)
        keep_sorted = (sp.cumsum(-1) - sp) < p.top_p
        keep = torch.zeros_like(keep_sorted).scatter(1, idx, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def expand_prefixes(
    weights: torch.Tensor,
    probs: torch.Tensor,
    seqs: torch.Tensor,
    prune: float,
    max_prefixes: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """One level of the prefix tree: every (prefix, next token) whose joint
    probability is at least ``prune`` (at most ``max_prefixes``, the likeliest).
    Returns the new weights and sequences, each one's parent prefix and last
    token, and the probability mass left out."""
    joint = (weights[:, None] * probs).flatten()
    cand = (joint >= prune).nonzero().squeeze(1)
    if cand.numel() > max_prefixes:
        cand = cand[joint[cand].topk(max_prefixes).indices]
    lost = float(weights.sum() - joint[cand].sum())
    parent, token = cand // probs.shape[1], cand % probs.shape[1]
    return (
        joint[cand],
        torch.cat([seqs[parent], token[:, None]], 1),
        parent,
        token,
        lost,
    )


class Target:
    """The HF target in float64 (CPU)."""

    def __init__(self, target_dir: Path | str) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            str(target_dir), dtype=DT
        ).eval()

    @torch.no_grad()
    def marginals(
        self,
        prompt: list[int],
        params: Params,
        n_tokens: int,
        prune: float = 1e-6,
        max_prefixes: int = 4096,
    ) -> Marginals:
        out = self.model(torch.tensor([prompt]), use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1].to(DT)
        weights = torch.ones(1, dtype=DT)
        seqs = torch.zeros(1, 0, dtype=torch.long)
        res = Marginals([], [], [])
        pruned = 0.0
        for t in range(n_tokens):
            probs = process(logits, prompt, seqs, params)  # [P, V]
            res.probs.append((weights[:, None] * probs).sum(0))
            res.pruned.append(pruned)
            res.prefixes.append(len(weights))
            if t == n_tokens - 1:
                break
            weights, seqs, parent, token, lost = expand_prefixes(
                weights, probs, seqs, prune, max_prefixes
            )
            pruned += lost
            if hasattr(cache, "reorder_cache"):
                cache.reorder_cache(parent)
            else:
                cache.batch_select_indices(parent)
            pos = len(prompt) + t
            out = self.model(
                token[:, None],
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.full((len(token), 1), pos),
            )
            cache, logits = out.past_key_values, out.logits[:, -1].to(DT)
        return res

    @torch.no_grad()
    def greedy(self, prompt: list[int], n: int) -> list[int]:
        seq = list(prompt)
        for _ in range(n):
            logits = self.model(torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
        return seq[len(prompt) :]


class HybridTarget(Target):
    """A Qwen3.5/3.6 hybrid target (``Qwen3_5ForConditionalGeneration``) in float64,
    with the float64 per-token Gated-DeltaNet recurrence of tests/helpers/reference.py.

    Each level of the prefix tree runs the whole sequences again (no cache: the
    hybrid cache's conv/recurrent states are not reordered here), in batches.
    """

    def __init__(self, target_dir: Path | str, batch: int = 512) -> None:
        from tests.helpers.reference import _load_target

        self.model = _load_target(Path(target_dir))
        self.batch = batch
        self._memo: dict[tuple, dict[tuple, torch.Tensor]] = {}

    @torch.no_grad()
    def _last_logits(self, prompt: list[int], seqs: torch.Tensor) -> torch.Tensor:
        """Next-token logits after ``prompt + seqs[i]``; memoised per sequence, so
        groups that share the prompt (different sampling parameters) share the
        forwards."""
        memo = self._memo.setdefault(tuple(prompt), {})
        keys = [tuple(r) for r in seqs.tolist()]
        todo = sorted({k for k in keys if k not in memo})
        for i in range(0, len(todo), self.batch):
            part = todo[i : i + self.batch]
            rows = torch.cat(
                [
                    torch.tensor(prompt).expand(len(part), -1),
                    torch.tensor(part, dtype=torch.long).view(len(part), -1),
                ],
                1,
            )
            logits = self.model(input_ids=rows).logits[:, -1].to(DT)
            memo.update(zip(part, logits, strict=True))
        return torch.stack([memo[k] for k in keys])

    @torch.no_grad()
    def marginals(
        self,
        prompt: list[int],
        params: Params,
        n_tokens: int,
        prune: float = 1e-6,
        max_prefixes: int = 4096,
    ) -> Marginals:
        weights = torch.ones(1, dtype=DT)
        seqs = torch.zeros(1, 0, dtype=torch.long)
        logits = self._last_logits(prompt, seqs)
        res = Marginals([], [], [])
        pruned = 0.0
        for t in range(n_tokens):
            probs = process(logits, prompt, seqs, params)
            res.probs.append((weights[:, None] * probs).sum(0))
            res.pruned.append(pruned)
            res.prefixes.append(len(weights))
            if t == n_tokens - 1:
                break
            weights, seqs, _, _, lost = expand_prefixes(
                weights, probs, seqs, prune, max_prefixes
            )
            pruned += lost
            logits = self._last_logits(prompt, seqs)
        return res

    @torch.no_grad()
    def greedy(self, prompt: list[int], n: int) -> list[int]:
        seq = list(prompt)
        for _ in range(n):
            logits = self.model(input_ids=torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
        return seq[len(prompt) :]
