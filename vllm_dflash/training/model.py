# SPDX-License-Identifier: Apache-2.0
"""A trainable DFlash drafter in plain PyTorch (same math as inference).

Parameter names equal the checkpoint keys that vLLM's DFlash loader reads
(``fc.weight``, ``layers.{i}.self_attn.q_proj.weight``, ...), so
``state_dict()`` is saved as ``model.safetensors`` unchanged. The target's
token embedding and lm_head are frozen buffers: the drafter shares them.

One forward call handles many blocks per sequence: block ``j`` (anchor
position ``a_j``) sees the context features at positions ``< a_j`` and its own
block; full layers attend bidirectionally inside the block, sliding layers are
causal with keys in ``p-W+1..p`` (context keys included), like the reference in
``tests/helpers/reference.py`` and the plugin's attention metadata.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox rotary embedding. x: [B, T, heads, hd]; pos: [B, T] or [T]."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = pos.to(torch.float64)[..., None] * inv
    cos = torch.cat([ang.cos()] * 2, -1).unsqueeze(-2).to(x.dtype)
    sin = torch.cat([ang.sin()] * 2, -1).unsqueeze(-2).to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h, hd = cfg["hidden_size"], cfg["head_dim"]
        self.nh, self.nkv, self.hd = (
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
            hd,
        )
        self.theta = cfg.get("rope_theta", 10000.0)
        eps = cfg["rms_norm_eps"]
        self.q_proj = nn.Linear(h, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, eps)
        self.k_norm = RMSNorm(hd, eps)

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        q_pos: torch.Tensor,
        ctx_pos: torch.Tensor,
        allowed: torch.Tensor,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        n = ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, t, self.nh, self.hd))
        q = rope(q, q_pos, self.theta)
        k_blk = rope(
            self.k_norm(self.k_proj(x).view(b, t, self.nkv, self.hd)), q_pos, self.theta
        )
        k_ctx = rope(
            self.k_norm(self.k_proj(ctx).view(b, n, self.nkv, self.hd)),
            ctx_pos,
            self.theta,
        )
        v_blk = self.v_proj(x).view(b, t, self.nkv, self.hd)
        v_ctx = self.v_proj(ctx).view(b, n, self.nkv, self.hd)
        k = torch.cat([k_ctx, k_blk], 1).transpose(1, 2)
        v = torch.cat([v_ctx, v_blk], 1).transpose(1, 2)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=allowed[:, None]
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class TrainableDrafter(nn.Module):
    """DFlash drafter for training; ``cfg`` is the drafter's config.json dict."""

    def __init__(
        self, cfg: dict, embed_tokens: torch.Tensor, lm_head: torch.Tensor
    ) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        n_feat = len(cfg["dflash_config"]["target_layer_ids"])
        self.cfg = cfg
        self.layer_types: list[str] = list(
            cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
        )
        self.window: int | None = cfg.get("sliding_window")
        self.mask_token_id = int(cfg["dflash_config"]["mask_token_id"])
        self.fc = nn.Linear(h * n_feat, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in self.layer_types)
        self.norm = RMSNorm(h, cfg["rms_norm_eps"])
        self.register_buffer("embed_tokens", embed_tokens, persistent=False)
        self.register_buffer("lm_head", lm_head, persistent=False)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.copy_(std * torch.randn(p.shape, generator=g))

    def masks(
        self, anchors: torch.Tensor, n_ctx: int, block: int
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Query positions [B, m*block] and boolean key masks per layer kind."""
        b, m = anchors.shape
        offs = torch.arange(block)
        q_pos = (anchors[:, :, None] + offs).reshape(b, m * block)
        q_blk = torch.arange(m).repeat_interleave(block)
        ctx_pos = torch.arange(n_ctx)
        # Context keys: strictly before the block's anchor.
        ctx_ok = (
            ctx_pos[None, None, :] < anchors.repeat_interleave(block, 1)[:, :, None]
        )
        blk_ok = (q_blk[:, None] == q_blk[None, :]).expand(b, -1, -1)
        full = torch.cat([ctx_ok, blk_ok], -1)
        key_pos = torch.cat([ctx_pos.expand(b, -1), q_pos], 1)
        masks = {"full_attention": full}
        if "sliding_attention" in self.layer_types:
            if self.window is None:
                raise ValueError("sliding_attention layers need sliding_window")
            d = q_pos[:, :, None] - key_pos[:, None, :]
            masks["sliding_attention"] = full & (d >= 0) & (d < self.window)
        return q_pos, ctx_pos, masks

    def forward(
        self, feats: torch.Tensor, block_tokens: torch.Tensor, anchors: torch.Tensor
    ) -> torch.Tensor:
        """Logits for every block position.

        feats: [B, N, hidden * n_layers] target features at positions 0..N-1;
        block_tokens: [B, m, block] (anchor token then masks);
        anchors: [B, m] position of each block's anchor token.
        Returns [B, m, block, vocab] (position 0 is the anchor; drafts are 1..).
        """
        b, m, block = block_tokens.shape
        q_pos, ctx_pos, masks = self.masks(anchors, feats.shape[1], block)
        ctx = self.hidden_norm(self.fc(feats.to(self.fc.weight.dtype)))
        r = self.embed_tokens[block_tokens.reshape(b, m * block)]
        for kind, layer in zip(self.layer_types, self.layers, strict=True):
            x = layer.input_layernorm(r)
            r = r + layer.self_attn(x, ctx, q_pos, ctx_pos, masks[kind])
            r = r + layer.mlp(layer.post_attention_layernorm(r))
        logits = self.norm(r) @ self.lm_head.T
        return logits.view(b, m, block, -1)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        return {
            k: v.detach().contiguous().clone() for k, v in self.state_dict().items()
        }
