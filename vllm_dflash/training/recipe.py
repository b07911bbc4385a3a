# SPDX-License-Identifier: Apache-2.0
"""The DFlash training recipe and an exact acceptance simulation.

Recipe (z-lab, arXiv 2602.06036): random anchor positions in each sequence;
block ``[anchor token, mask x (B-1)]``; context = target features strictly
before the anchor; cross-entropy on the B-1 masked positions with weights
``exp(-(k-1)/gamma)`` for the k-th draft (early drafts matter most: one miss
ends the accepted run).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from vllm_dflash.training.data import Corpus
from vllm_dflash.training.model import TrainableDrafter


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 600
    batch_sequences: int = 16
    anchors_per_sequence: int = 8
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup: int = 30
    loss_gamma: float = 4.0
    init_std: float = 0.02
    grad_clip: float = 1.0

    def as_dict(self) -> dict:
        return asdict(self)


def position_weights(block: int, gamma: float) -> torch.Tensor:
    k = torch.arange(1, block, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def sample_anchors(
    prompt_lens: torch.Tensor, length: int, block: int, m: int, g: torch.Generator
) -> torch.Tensor:
    """[S, m] anchors in [prompt_len - 1, length - block] (continuation region)."""
    lo = (prompt_lens - 1).clamp(min=1).to(torch.float32)
    hi = float(length - block)
    u = torch.rand(len(prompt_lens), m, generator=g)
    return (lo[:, None] + u * (hi - lo[:, None] + 1)).floor().long()


def blocks_for(
    tokens: torch.Tensor, anchors: torch.Tensor, block: int, mask_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block inputs [S, m, B] and labels [S, m, B-1] for the given anchors."""
    idx = anchors[:, :, None] + torch.arange(block)
    gathered = torch.gather(tokens[:, None, :].expand(-1, idx.shape[1], -1), 2, idx)
    inputs = torch.full_like(gathered, mask_id)
    inputs[:, :, 0] = gathered[:, :, 0]
    return inputs, gathered[:, :, 1:]


def train(
    model: TrainableDrafter,
    corpus: Corpus,
    block: int,
    cfg: TrainConfig,
    log_every: int = 100,
    log=print,
) -> list[dict]:
    """Train in place; returns the loss history (one entry per ``log_every``)."""
    torch.manual_seed(cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed)
    model.init_weights(cfg.seed, cfg.init_std)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
    )

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    w = position_weights(block, cfg.loss_gamma)
    length = corpus.tokens.shape[1]
    history, t0, acc = [], time.monotonic(), 0.0
    model.train()
    for step in range(cfg.steps):
        rows = torch.randint(0, len(corpus.tokens), (cfg.batch_sequences,), generator=g)
        anchors = sample_anchors(
            corpus.prompt_lens[rows], length, block, cfg.anchors_per_sequence, g
        )
        inputs, labels = blocks_for(
            corpus.tokens[rows], anchors, block, model.mask_token_id
        )
        logits = model(corpus.features[rows], inputs, anchors)[:, :, 1:]
        ce = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none"
        ).view(labels.shape)
        loss = (ce * w).sum() / (w.sum() * labels.shape[0] * labels.shape[1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        acc += loss.item()
        if (step + 1) % log_every == 0 or step + 1 == cfg.steps:
            n = (step % log_every) + 1
            entry = {
                "step": step + 1,
                "loss": round(acc / n, 4),
                "seconds": round(time.monotonic() - t0, 1),
            }
            history.append(entry)
            log(
                f"step {entry['step']:5d}  loss {entry['loss']:.4f}  {entry['seconds']}s"
            )
            acc = 0.0
    model.eval()
    return history


@torch.no_grad()
def draft_all(
    model: TrainableDrafter, corpus: Corpus, block: int, features: torch.Tensor
) -> torch.Tensor:
    """Greedy drafts [S, L, B-1] for every anchor position (invalid ones are -1)."""
    s, length = corpus.tokens.shape
    anchors = torch.arange(length - block + 1)
    out = torch.full((s, length, block - 1), -1, dtype=torch.long)
    for i in range(s):
        a = anchors[None]
        inputs, _ = blocks_for(corpus.tokens[i : i + 1], a, block, model.mask_token_id)
        logits = model(features[i : i + 1], inputs, a)
        out[i, : len(anchors)] = logits[0, :, 1:].argmax(-1)
    return out


@torch.no_grad()
def simulate_acceptance(
    model: TrainableDrafter,
    corpus: Corpus,
    block: int,
    features: torch.Tensor | None = None,
) -> dict[str, float]:
    """Mean acceptance length (accepted + 1 per drafting step) of greedy spec
    decoding over each sequence's continuation, as vLLM counts it."""
    feats = corpus.features if features is None else features
    drafts = draft_all(model, corpus, block, feats)
    tokens = corpus.tokens
    length = tokens.shape[1]
    steps, total, first = 0, 0, 0
    for i in range(len(tokens)):
        a = int(corpus.prompt_lens[i]) - 1
        while a + block - 1 <= length - 1:
            ok = (drafts[i, a] == tokens[i, a + 1 : a + block]).long()
            accepted = int(ok.cumprod(0).sum())
            steps += 1
            total += accepted + 1
            first += int(ok[0])
            a += accepted + 1
    return {
        "acceptance_length": total / max(steps, 1),
        "first_token_accuracy": first / max(steps, 1),
        "steps": steps,
    }
