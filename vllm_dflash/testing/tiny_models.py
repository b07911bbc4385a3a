# SPDX-License-Identifier: Apache-2.0
"""Deterministic tiny Hugging Face checkpoints for tests and the demo.

Everything is built locally from a seed (no network): a Qwen3 target, a dense
DFlash drafter, a drafter whose ``layer_types`` mix ``sliding_attention`` and
``full_attention`` with a window shorter than the test prompts, and a
WordLevel tokenizer with a chat template.

Usage: ``python -m vllm_dflash.testing.tiny_models OUT_DIR`` (prints the paths).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

VOCAB_SIZE = 512
NUM_SPECIAL = 4  # <pad>, <bos>, <eos>, <mask>
PAD_ID, BOS_ID, EOS_ID, MASK_ID = 0, 1, 2, 3
GENERATOR_VERSION = "2"

CHAT_TEMPLATE = (
    "{% for m in messages %}<t{{ 10 + (m['role'] | length) }}> {{ m['content'] }} "
    "{% endfor %}{% if add_generation_prompt %}<t20> {% endif %}"
)


@dataclass(frozen=True)
class TargetSpec:
    hidden_size: int = 128
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    seed: int = 0
    init_std: float = 0.08
    # MLP weights' std when it differs from init_std (MLPs act per token: large
    # ones make consecutive layers' features differ without mixing context).
    mlp_std: float | None = None


@dataclass(frozen=True)
class DrafterSpec:
    name: str
    layer_types: tuple[str, ...]
    target_layer_ids: tuple[int, ...]
    block_size: int = 8
    sliding_window: int | None = None
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    seed: int = 1
    # Large enough that drafts depend on the context (features, window), which
    # is what the equivalence and A/B tests need to see.
    init_std: float = 0.3
    extra: dict = field(default_factory=dict)


TARGET = TargetSpec()
DENSE_DRAFTER = DrafterSpec(
    name="drafter-dense",
    layer_types=("full_attention", "full_attention"),
    target_layer_ids=(1, 3, 4),
)
SWA_DRAFTER = DrafterSpec(
    name="drafter-swa",
    layer_types=("sliding_attention", "sliding_attention", "full_attention"),
    target_layer_ids=(0, 2, 4),
    sliding_window=6,
    seed=2,
)


def _tokenizer_files(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    specials = ["<pad>", "<bos>", "<eos>", "<mask>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for i in range(NUM_SPECIAL, VOCAB_SIZE):
        vocab[f"<t{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "pad_token": "<pad>",
                "unk_token": "<pad>",
                "mask_token": "<mask>",
                "model_max_length": 4096,
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"})
    )


def _qwen3_config(spec: TargetSpec) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
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
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": BOS_ID,
        # Never stop early: generation length is set by max_tokens.
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
        "use_sliding_window": False,
    }


def _init_(
    tensors: dict[str, torch.Tensor],
    seed: int,
    std: float,
    mlp_std: float | None = None,
) -> None:
    g = torch.Generator().manual_seed(seed)
    for name in sorted(tensors):
        t = tensors[name]
        if "norm" in name:
            # Norm weights around 1 so that they matter but stay well conditioned.
            t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=g))
        else:
            s = mlp_std if (mlp_std is not None and ".mlp." in name) else std
            t.copy_(s * torch.randn(t.shape, generator=g))


def build_target(out: Path, spec: TargetSpec = TARGET) -> Path:
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    cfg = _qwen3_config(spec)
    model = Qwen3ForCausalLM(Qwen3Config(**cfg))
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    _init_(state, spec.seed, spec.init_std, spec.mlp_std)
    # Embeddings larger than the rest so the residual stream carries the tokens.
    g = torch.Generator().manual_seed(spec.seed + 1000)
    state["model.embed_tokens.weight"] = torch.randn(
        VOCAB_SIZE, spec.hidden_size, generator=g
    )
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID})
    )
    _tokenizer_files(out)
    return out


def drafter_config(spec: DrafterSpec, target: TargetSpec = TARGET) -> dict:
    n = len(spec.layer_types)
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": target.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": n,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "float32",
        "block_size": spec.block_size,
        "num_target_layers": target.num_layers,
        "dflash_config": {
            "mask_token_id": MASK_ID,
            "target_layer_ids": list(spec.target_layer_ids),
        },
        "layer_types": list(spec.layer_types),
    }
    if spec.sliding_window is not None:
        cfg.update(
            use_sliding_window=True,
            sliding_window=spec.sliding_window,
            max_window_layers=n,
        )
    else:
        cfg.update(use_sliding_window=False, sliding_window=None)
    cfg.update(spec.extra)
    return cfg


def drafter_state_dict(
    spec: DrafterSpec, target: TargetSpec = TARGET
) -> dict[str, torch.Tensor]:
    h = target.hidden_size
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, h * len(spec.target_layer_ids)),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(len(spec.layer_types)):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (spec.head_dim,),
                p + "self_attn.k_norm.weight": (spec.head_dim,),
                p + "mlp.gate_proj.weight": (spec.intermediate_size, h),
                p + "mlp.up_proj.weight": (spec.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, spec.intermediate_size),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
    state = {k: torch.empty(s) for k, s in shapes.items()}
    _init_(state, spec.seed, spec.init_std)
    return state


def build_drafter(
    out: Path,
    spec: DrafterSpec,
    target: TargetSpec = TARGET,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = drafter_state_dict(spec, target) if state is None else state
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(drafter_config(spec, target), indent=1))
    return out


def _fingerprint(*specs: object) -> str:
    blob = json.dumps([GENERATOR_VERSION, [repr(s) for s in specs]]).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


@dataclass(frozen=True)
class TinyModels:
    root: Path
    target: Path
    dense: Path
    swa: Path


def default_cache_dir() -> Path:
    env = os.environ.get("VLLM_DFLASH_FIXTURES")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / (
        "vllm-dflash/fixtures"
    )


def ensure_tiny_models(cache_dir: Path | None = None) -> TinyModels:
    """Build (once) and return the paths of the tiny fixture checkpoints."""
    root = (cache_dir or default_cache_dir()) / _fingerprint(
        TARGET, DENSE_DRAFTER, SWA_DRAFTER
    )
    models = TinyModels(
        root=root,
        target=root / "target",
        dense=root / DENSE_DRAFTER.name,
        swa=root / SWA_DRAFTER.name,
    )
    done = root / ".complete"
    if done.exists():
        return models
    build_target(models.target)
    build_drafter(models.dense, DENSE_DRAFTER)
    build_drafter(models.swa, SWA_DRAFTER)
    done.write_text("ok\n")
    return models


# GPU variants: FlashAttention 3 (Hopper) needs head_dim 64/128/256.
GPU_TARGET = TargetSpec(
    hidden_size=256, num_heads=2, num_kv_heads=1, head_dim=128, intermediate_size=512
)
GPU_DENSE = DrafterSpec(
    name="drafter-dense",
    layer_types=("full_attention", "full_attention"),
    target_layer_ids=(1, 3, 4),
    num_heads=2, num_kv_heads=1, head_dim=128, intermediate_size=512,
)  # fmt: skip
GPU_SWA = DrafterSpec(
    name="drafter-swa",
    layer_types=("sliding_attention", "sliding_attention", "full_attention"),
    target_layer_ids=(0, 2, 4),
    sliding_window=6, seed=2,
    num_heads=2, num_kv_heads=1, head_dim=128, intermediate_size=512,
)  # fmt: skip


def ensure_gpu_tiny_models(cache_dir: Path | None = None) -> TinyModels:
    """Same layout as ensure_tiny_models with FlashAttention-friendly head_dim 128."""
    root = (cache_dir or default_cache_dir()) / (
        "gpu-" + _fingerprint(GPU_TARGET, GPU_DENSE, GPU_SWA)
    )
    models = TinyModels(
        root=root,
        target=root / "target",
        dense=root / "drafter-dense",
        swa=root / "drafter-swa",
    )
    if not (root / ".complete").exists():
        build_target(models.target, GPU_TARGET)
        build_drafter(models.dense, GPU_DENSE, GPU_TARGET)
        build_drafter(models.swa, GPU_SWA, GPU_TARGET)
        (root / ".complete").write_text("ok\n")
    return models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=None)
    args = parser.parse_args()
    models = ensure_tiny_models(args.out)
    print(json.dumps({k: str(v) for k, v in models.__dict__.items()}, indent=1))


if __name__ == "__main__":
    main()
