# SPDX-License-Identifier: Apache-2.0
"""Pure-PyTorch float64 reference of one DFlash drafting step.

Written from the DFlash description (z-lab, arXiv 2602.06036) and the HF
checkpoints, independently of vLLM's code:

* features: outputs of the target decoder layers in ``target_layer_ids``
  (HF ``hidden_states[id + 1]``) at the context positions 0..N-2;
* fc, hidden_norm; per drafter layer: K/V projection of that, k_norm, RoPE at
  positions 0..N-2 (no input_layernorm on the context);
* query block ``[newest, mask x k]`` at positions N-1..N-1+k, embedded with the
  target's embedding; full layers: every block token sees all context and block
  keys; sliding layers: causal, keys in ``p-W+1..p``;
* final norm, target lm_head, argmax at the k mask positions.

Hybrid targets (Qwen3.5/3.6, ``Qwen3_5ForConditionalGeneration``): features
come from transformers' model the same way (``hidden_states[id + 1]`` of the
language model); its Gated-DeltaNet layers run a plain per-token float64
recurrence (:func:`gated_delta_rule_f64`) instead of transformers' fallbacks,
which compute in float32. Image prompts: transformers' model gets the images
(:meth:`Reference.mm_inputs`) and computes its M-RoPE positions itself; the
drafter's positions stay the token index (docs/hybrid.md).
"""

from __future__ import annotations

import functools
import json
import types
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

DT = torch.float64


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding; x: [T, heads, head_dim]."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=DT) / hd))
    ang = pos.to(DT)[:, None] * inv[None, :]
    cos, sin = (
        torch.cat([ang.cos()] * 2, -1)[:, None],
        torch.cat([ang.sin()] * 2, -1)[:, None],
    )
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def gated_delta_rule_f64(
    query, key, value, g, beta, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, **_,
):  # fmt: skip
    """Gated delta rule, one token at a time, float64; HF layout ([B, T, H, D], state [K, V])."""
    q, k, v, g, beta = (x.to(DT) for x in (query, key, value, g, beta))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    b, t, h, dk = k.shape
    state = (
        torch.zeros(b, h, dk, v.shape[-1], dtype=DT)
        if initial_state is None
        else initial_state.to(DT)
    )
    out = torch.zeros_like(v)
    for i in range(t):
        state = state * g[:, i].exp()[..., None, None]
        delta = (v[:, i] - torch.einsum("bhkv,bhk->bhv", state, k[:, i])) * beta[
            :, i, :, None
        ]
        state = state + k[:, i, :, :, None] * delta[:, :, None, :]
        out[:, i] = torch.einsum("bhkv,bhk->bhv", state, q[:, i])
    return out.to(query.dtype), (state if output_final_state else None)


def _depthwise_conv1d_f64(conv: torch.nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """The GDN layer's depthwise causal conv (``groups == channels``) as W shifted
    multiply-adds: torch's float64 CPU conv1d loops over the groups (seconds per
    call at 1024 channels, the GPU fixture's width). Same padding and output length.
    Bound as ``conv.forward`` with MethodType, so a deepcopy of the model keeps it
    bound to its own weights."""
    pad, width = conv.padding[0], conv.kernel_size[0]
    xp = F.pad(x, (pad, pad))
    n = xp.shape[-1] - width + 1
    w = conv.weight[:, 0]  # [C, W]
    out = sum(w[None, :, j, None] * xp[..., j : j + n] for j in range(width))
    return out if conv.bias is None else out + conv.bias[None, :, None]


def one_thread(fn):
    """Run ``fn`` with one torch thread: the reference's float64 ops are small,
    and with 2 threads on a busy 2-core machine they spent most of their time
    waiting on each other (drafts of one test: 36 s with 2 threads, 0.9 s with 1)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(before)

    return wrapper


def _load_target(target_dir: Path) -> torch.nn.Module:
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    if "text_config" in cfg:  # multimodal wrapper (Qwen3.5/3.6)
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(
            target_dir, torch_dtype=DT, attn_implementation="eager"
        ).eval()
        for module in model.modules():
            if hasattr(module, "chunk_gated_delta_rule"):
                module.chunk_gated_delta_rule = gated_delta_rule_f64
                module.recurrent_gated_delta_rule = gated_delta_rule_f64
                conv = module.conv1d
                assert conv.groups == conv.in_channels == conv.out_channels
                conv.forward = types.MethodType(_depthwise_conv1d_f64, conv)
        return model
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        target_dir, torch_dtype=DT, attn_implementation="eager"
    ).eval()


@dataclass
class Reference:
    target: torch.nn.Module
    target_cfg: dict
    drafter: dict[str, torch.Tensor]
    drafter_cfg: dict
    layer_ids: list[int]
    mask_id: int
    layer_types: list[str]
    window: int | None
    target_dir: Path | None = None

    @classmethod
    def load(cls, target_dir: Path, drafter_dir: Path) -> Reference:
        target = _load_target(target_dir)
        dcfg = json.loads((Path(drafter_dir) / "config.json").read_text())
        n = dcfg["num_hidden_layers"]
        return cls(
            target=target,
            target_cfg=json.loads((Path(target_dir) / "config.json").read_text()),
            drafter={
                k: v.to(DT)
                for k, v in load_file(
                    str(Path(drafter_dir) / "model.safetensors")
                ).items()
            },
            drafter_cfg=dcfg,
            layer_ids=list(dcfg["dflash_config"]["target_layer_ids"]),
            mask_id=int(dcfg["dflash_config"]["mask_token_id"]),
            layer_types=dcfg.get("layer_types") or ["full_attention"] * n,
            window=dcfg.get("sliding_window"),
            target_dir=Path(target_dir),
        )

    def mm_inputs(self, seq: list[int], images: list | None) -> dict:
        """transformers' image inputs for ``seq`` (Qwen3.5: pixel values from the
        checkpoint's own image processor, as vLLM feeds its vision tower, the
        grid, and which tokens are image tokens; M-RoPE follows from them).
        ``images``: ``[width, height, seed]`` specs (tests/helpers/images.py)."""
        if not images:
            return {}
        from transformers import AutoImageProcessor

        from tests.helpers.images import make_image

        proc = AutoImageProcessor.from_pretrained(self.target_dir)
        px = proc(images=[make_image(*spec) for spec in images], return_tensors="pt")
        ids = torch.tensor([seq])
        return {
            "pixel_values": px["pixel_values"].to(DT),
            "image_grid_thw": px["image_grid_thw"],
            "mm_token_type_ids": (ids == self.target_cfg["image_token_id"]).long(),
        }

    @one_thread
    @torch.no_grad()
    def logits(self, seq: list[int], images: list | None = None) -> torch.Tensor:
        """[len(seq), vocab]: the target's float64 logits."""
        out = self.target(torch.tensor([seq]), **self.mm_inputs(seq, images))
        return out.logits[0]

    @one_thread
    @torch.no_grad()
    def features(self, seq: list[int], images: list | None = None) -> torch.Tensor:
        """[len(seq), hidden * len(layer_ids)]: output of each chosen target layer
        (``images``: see :meth:`mm_inputs`; the drafter's own positions stay the
        token index, see :meth:`draft`)."""
        out = self.target(
            torch.tensor([seq]),
            output_hidden_states=True,
            **self.mm_inputs(seq, images),
        )
        n_layers = self.target_cfg.get("text_config", self.target_cfg)[
            "num_hidden_layers"
        ]
        assert all(i < n_layers - 1 for i in self.layer_ids)  # hs[L] is normed
        return torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], -1)

    @one_thread
    @torch.no_grad()
    def draft(
        self, seq: list[int], k: int, feats: torch.Tensor | None = None
    ) -> tuple[list[int], torch.Tensor]:
        """Draft k tokens after ``seq`` (whose last token opens the block)."""
        c, w = self.drafter_cfg, self.drafter
        eps, theta = c["rms_norm_eps"], c.get("rope_theta", 10000.0)
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        n = len(seq)
        if feats is None:
            feats = self.features(seq[:-1])
        ctx = rms_norm(feats[: n - 1] @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        ctx_pos = torch.arange(n - 1)
        q_pos = torch.arange(n - 1, n + k)
        all_pos = torch.cat([ctx_pos, q_pos])
        emb = self.target.get_input_embeddings().weight
        h = emb[torch.tensor([seq[-1]] + [self.mask_id] * k)]
        residual = None
        for i, kind in enumerate(self.layer_types):
            p = f"layers.{i}."
            residual = h if residual is None else h + residual
            x = rms_norm(residual, w[p + "input_layernorm.weight"], eps)

            def proj(t, name, heads, p=p):
                return (t @ w[p + f"self_attn.{name}.weight"].T).view(
                    t.shape[0], heads, hd
                )

            kn = w[p + "self_attn.k_norm.weight"]
            q = rope(
                rms_norm(proj(x, "q_proj", nh), w[p + "self_attn.q_norm.weight"], eps),
                q_pos,
                theta,
            )
            kq = rope(rms_norm(proj(x, "k_proj", nkv), kn, eps), q_pos, theta)
            kc = rope(rms_norm(proj(ctx, "k_proj", nkv), kn, eps), ctx_pos, theta)
            keys = torch.cat([kc, kq])
            vals = torch.cat([proj(ctx, "v_proj", nkv), proj(x, "v_proj", nkv)])
            rep = nh // nkv
            keys, vals = keys.repeat_interleave(rep, 1), vals.repeat_interleave(rep, 1)
            scores = torch.einsum("qhd,khd->hqk", q, keys) * hd**-0.5
            if kind == "sliding_attention":
                qp, kp = q_pos[:, None], all_pos[None, :]
                allowed = (kp <= qp) & (kp > qp - self.window)
                scores = scores.masked_fill(~allowed[None], float("-inf"))
            attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals).reshape(
                k + 1, nh * hd
            )
            h = attn @ w[p + "self_attn.o_proj.weight"].T
            residual = h + residual
            x = rms_norm(residual, w[p + "post_attention_layernorm.weight"], eps)
            gate = x @ w[p + "mlp.gate_proj.weight"].T
            up = x @ w[p + "mlp.up_proj.weight"].T
            h = (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        out = rms_norm(h + residual, w["norm.weight"], eps)
        logits = out[1:] @ self.target.lm_head.weight.T
        return logits.argmax(-1).tolist(), logits
