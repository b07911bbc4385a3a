# SPDX-License-Identifier: Apache-2.0
"""Training data for a DFlash drafter: the target's own greedy continuations.

Synthetic prompts (random token ids, mixed lengths) are continued greedily by
the Hugging Face target; the features DFlash conditions on are the outputs of
the target layers in ``target_layer_ids`` (HF ``hidden_states[id + 1]``, the
semantics of vLLM PR #40727) at every position of the finished sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Corpus:
    tokens: torch.Tensor  # [S, L] prompt + greedy continuation
    prompt_lens: torch.Tensor  # [S]
    features: torch.Tensor  # [S, L, hidden * len(layer_ids)]


def synthetic_prompts(
    n: int,
    lengths: tuple[int, int],
    vocab: tuple[int, int],
    seed: int,
    bucket: int = 5,
) -> list[list[int]]:
    """``n`` prompts with lengths from ``lengths`` (inclusive) in steps of
    ``bucket`` tokens: few distinct lengths keep batched generation fast."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = lengths
    choices = torch.arange(lo, hi + 1, bucket)
    lens = choices[torch.randint(0, len(choices), (n,), generator=g)].tolist()
    return [torch.randint(*vocab, (ln,), generator=g).tolist() for ln in lens]


@torch.no_grad()
def greedy_continue(
    target: torch.nn.Module, prompts: list[list[int]], new_tokens: int
) -> list[list[int]]:
    """Greedy continuation (never stops at EOS), batched by prompt length."""
    out: dict[int, list[int]] = {}
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for idx in by_len.values():
        ids = torch.tensor([prompts[i] for i in idx])
        res = target(ids, use_cache=True)
        past, seqs = res.past_key_values, [ids]
        nxt = res.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(new_tokens - 1):
            seqs.append(nxt)
            res = target(nxt, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = res.logits[:, -1].argmax(-1, keepdim=True)
        seqs.append(nxt)
        full = torch.cat(seqs, 1)
        for row, i in enumerate(idx):
            out[i] = full[row].tolist()
    return [out[i] for i in range(len(prompts))]


@torch.no_grad()
def target_features(
    target: torch.nn.Module, tokens: torch.Tensor, layer_ids: list[int]
) -> torch.Tensor:
    """[S, L, hidden * len(layer_ids)]: output of decoder layer ``id`` for each id."""
    hs = target(tokens, output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in layer_ids], -1)


def build_corpus(
    target: torch.nn.Module,
    layer_ids: list[int],
    num_sequences: int,
    prompt_lengths: tuple[int, int],
    new_tokens: int,
    vocab: tuple[int, int],
    seed: int,
    batch: int = 64,
) -> Corpus:
    """Every row is one sequence (prompt + continuation, no padding); rows are
    cut to the shortest total length so that they stack."""
    prompts = synthetic_prompts(num_sequences, prompt_lengths, vocab, seed)
    seqs = greedy_continue(target, prompts, new_tokens)
    length = min(len(s) for s in seqs)
    tokens = torch.tensor([s[:length] for s in seqs])
    feats = torch.cat(
        [
            target_features(target, tokens[i : i + batch], layer_ids)
            for i in range(0, len(tokens), batch)
        ]
    )
    return Corpus(tokens, torch.tensor([len(p) for p in prompts]), feats)
