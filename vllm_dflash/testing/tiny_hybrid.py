# SPDX-License-Identifier: Apache-2.0
"""Deterministic tiny Qwen3.5/3.6-shaped hybrid target and its DFlash drafter.

The target has the architecture users deploy (Qwen3.6-27B):
``Qwen3_5ForConditionalGeneration`` with a (tiny) vision tower, text layers
``[GDN, GDN, GDN, gated full attention] x 2``, M-RoPE (interleaved sections,
partial rotary), GQA in the GDN heads. The drafter is a ``DFlashDraftModel``
with layers ``[sliding, sliding, full]`` and target layer ids that mix GDN and
attention layers. Built from a seed with transformers (no network), cached
like the other fixtures. Vocabulary 512 as in ``tiny_models``; the vision
special tokens sit above the ids the test prompts use (4..503).

Usage: ``python -m vllm_dflash.testing.tiny_hybrid [OUT_DIR]`` (prints the paths).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_dflash.testing.tiny_models import (
    BOS_ID,
    EOS_ID,
    VOCAB_SIZE,
    DrafterSpec,
    TargetSpec,
    _fingerprint,
    _init_,
    _tokenizer_files,
    build_drafter,
    default_cache_dir,
)

IMAGE_ID, VIDEO_ID, VISION_START_ID, VISION_END_ID = 504, 505, 506, 507
# 2: the vision special tokens are named (Qwen's processor looks them up by name).
HYBRID_VERSION = "2"
VISION_TOKENS = {
    IMAGE_ID: "<|image_pad|>",
    VIDEO_ID: "<|video_pad|>",
    VISION_START_ID: "<|vision_start|>",
    VISION_END_ID: "<|vision_end|>",
}


@dataclass(frozen=True)
class HybridSpec:
    hidden_size: int = 128
    num_layers: int = 8
    full_attention_interval: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    conv_kernel: int = 4
    # rotary dim = head_dim * 0.25 = 8 -> 4 frequencies, sections [t, h, w].
    mrope_section: tuple[int, int, int] = (2, 1, 1)
    vision_hidden: int = 32
    vision_heads: int = 2
    vision_depth: int = 1
    patch_size: int = 8
    seed: int = 10
    init_std: float = 0.08


HYBRID = HybridSpec()


def text_spec(spec: HybridSpec) -> TargetSpec:
    """TargetSpec view of the text model (drafter_config reads these fields)."""
    return TargetSpec(
        hidden_size=spec.hidden_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
    )


_TEXT = text_spec(HYBRID)
HYBRID_DRAFTER = DrafterSpec(
    name="drafter-hybrid",
    layer_types=("sliding_attention", "sliding_attention", "full_attention"),
    target_layer_ids=(1, 3, 6),  # GDN, gated attention, GDN
    sliding_window=6,
    seed=12,
)


def layer_types(spec: HybridSpec = HYBRID) -> list[str]:
    k = spec.full_attention_interval
    return [
        "full_attention" if (i + 1) % k == 0 else "linear_attention"
        for i in range(spec.num_layers)
    ]


def hybrid_config(spec: HybridSpec = HYBRID) -> dict:
    text = {
        "model_type": "qwen3_5_text",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attn_output_gate": True,
        "full_attention_interval": spec.full_attention_interval,
        "layer_types": layer_types(spec),
        "linear_conv_kernel_dim": spec.conv_kernel,
        "linear_key_head_dim": spec.linear_key_head_dim,
        "linear_value_head_dim": spec.linear_value_head_dim,
        "linear_num_key_heads": spec.linear_num_key_heads,
        "linear_num_value_heads": spec.linear_num_value_heads,
        "mtp_num_hidden_layers": 0,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": list(spec.mrope_section),
        },
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    vision = {
        "model_type": "qwen3_5",
        "depth": spec.vision_depth,
        "hidden_size": spec.vision_hidden,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": 2 * spec.vision_hidden,
        "num_heads": spec.vision_heads,
        "in_channels": 3,
        "patch_size": spec.patch_size,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": spec.hidden_size,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [],
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": IMAGE_ID,
        "video_token_id": VIDEO_ID,
        "vision_start_token_id": VISION_START_ID,
        "vision_end_token_id": VISION_END_ID,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


def build_hybrid_target(
    out: Path, spec: HybridSpec = HYBRID, mlp_std: float | None = None
) -> Path:
    """Seeded weights (``mlp_std``: std of the MLP weights where it differs from
    ``spec.init_std``; see ``trained_hybrid``)."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    cfg = hybrid_config(spec)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(**cfg))
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    _init_(state, spec.seed, spec.init_std, mlp_std)
    g = torch.Generator().manual_seed(spec.seed + 1000)
    for name in state:
        if name.endswith("embed_tokens.weight"):
            state[name] = torch.randn(VOCAB_SIZE, spec.hidden_size, generator=g)
        elif name.endswith("linear_attn.A_log"):
            # decay rates exp(A_log) in ~[0.1, 1]: the recurrence remembers context
            state[name] = torch.empty(state[name].shape).uniform_(
                -2.3, 0.0, generator=g
            )
        elif name.endswith("linear_attn.dt_bias"):
            state[name] = torch.zeros(state[name].shape)
        elif name.endswith("linear_attn.conv1d.weight"):
            state[name] = 0.5 * torch.randn(state[name].shape, generator=g)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID})
    )
    _tokenizer_files(out)
    _name_vision_tokens(out)
    _processor_files(out, spec)
    return out


def _name_vision_tokens(out: Path) -> None:
    """Give ids 504..507 the names Qwen's processor (transformers and vLLM) looks
    up (``<|image_pad|>`` ...), as special tokens, so image prompts work offline."""
    path = out / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    for tid, name in VISION_TOKENS.items():
        del vocab[f"<t{tid}>"]
        vocab[name] = tid
        tok["added_tokens"].append(
            {"id": tid, "content": name, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
        )  # fmt: skip
    path.write_text(json.dumps(tok))


def _processor_files(out: Path, spec: HybridSpec) -> None:
    """Image processor config for the tiny vision tower (patch 8, merge 2)."""
    px = spec.patch_size * 2
    (out / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen2VLImageProcessorFast",
                "patch_size": spec.patch_size,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "min_pixels": px * px,
                "max_pixels": 16 * px * px,
                "size": {"shortest_edge": px * px, "longest_edge": 16 * px * px},
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
            },
            indent=1,
        )
    )


@dataclass(frozen=True)
class TinyHybrid:
    root: Path
    target: Path
    drafter: Path


def _ensure(
    cache_dir: Path | None, prefix: str, spec: HybridSpec, drafter: DrafterSpec
) -> TinyHybrid:
    root = (cache_dir or default_cache_dir()) / (
        prefix + _fingerprint(HYBRID_VERSION, spec, drafter)
    )
    models = TinyHybrid(root=root, target=root / "target", drafter=root / drafter.name)
    if not (root / ".complete").exists():
        build_hybrid_target(models.target, spec)
        build_drafter(models.drafter, drafter, text_spec(spec))
        (root / ".complete").write_text("ok\n")
    return models


def ensure_tiny_hybrid(cache_dir: Path | None = None) -> TinyHybrid:
    """Build (once) and return the tiny hybrid target and its drafter."""
    return _ensure(cache_dir, "hybrid-", HYBRID, HYBRID_DRAFTER)


# GPU variant (benchmarks/gpu/gpu_check.py): the same structure with head sizes the
# CUDA kernels are built for. Attention head_dim 128 (FlashAttention: multiples of 8
# up to 256), GDN key/value head dims 128 as in Qwen3.5/3.6 (FLA kernels: K <= 256),
# partial rotary 0.25 -> 32 rotary dims -> 16 M-RoPE frequencies (6 + 5 + 5), vision
# heads of 64. Target attention and drafter layers have the same KV bytes per token
# (1 KV head of 128), so vLLM can unify their pages with the GDN state pages.
GPU_HYBRID = HybridSpec(
    hidden_size=256, num_heads=2, num_kv_heads=1, head_dim=128, intermediate_size=512,
    linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=128, linear_value_head_dim=128,
    mrope_section=(6, 5, 5), vision_hidden=128, vision_heads=2,
)  # fmt: skip
GPU_HYBRID_DRAFTER = DrafterSpec(
    name="drafter-hybrid",
    layer_types=("sliding_attention", "sliding_attention", "full_attention"),
    target_layer_ids=(1, 3, 6),  # GDN, gated attention, GDN
    sliding_window=6, seed=12,
    num_heads=2, num_kv_heads=1, head_dim=128, intermediate_size=512,
)  # fmt: skip


def ensure_gpu_tiny_hybrid(cache_dir: Path | None = None) -> TinyHybrid:
    """The hybrid pair with CUDA-kernel-friendly head sizes (GPU check)."""
    return _ensure(cache_dir, "gpu-hybrid-", GPU_HYBRID, GPU_HYBRID_DRAFTER)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=None)
    parser.add_argument("--gpu", action="store_true", help="the GPU variant")
    args = parser.parse_args()
    models = (ensure_gpu_tiny_hybrid if args.gpu else ensure_tiny_hybrid)(args.out)
    print(json.dumps({k: str(v) for k, v in models.__dict__.items()}, indent=1))


if __name__ == "__main__":
    main()
