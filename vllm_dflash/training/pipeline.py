# SPDX-License-Identifier: Apache-2.0
"""Train a DFlash drafter for a Hugging Face target and save a vLLM-loadable
checkpoint (``config.json`` + ``model.safetensors`` + ``training.json``).

    python -m vllm_dflash.training --target TARGET_DIR --out DRAFTER_DIR \\
        --layer-types full_attention,full_attention --target-layer-ids 1,3,4 \\
        --block-size 8 --mask-token-id 3 --seed 0

Meant for small targets (the test fixtures, demos): the whole corpus and its
features are kept in memory, and training runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_dflash.training.data import Corpus, build_corpus
from vllm_dflash.training.model import TrainableDrafter
from vllm_dflash.training.recipe import TrainConfig, simulate_acceptance, train


@dataclass(frozen=True)
class DataConfig:
    num_sequences: int = 512
    eval_sequences: int = 32
    prompt_lengths: tuple[int, int] = (5, 40)
    new_tokens: int = 88
    seed: int = 0


def drafter_config_for(
    target_cfg: dict,
    layer_types: list[str],
    target_layer_ids: list[int],
    block_size: int,
    mask_token_id: int,
    sliding_window: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
) -> dict:
    """A DFlashDraftModel config.json derived from the target's config."""
    # A hybrid's text model type (qwen3_5_text) is no drafter type: DFlash
    # drafters are Qwen3-style.
    model_type = "qwen3" if "text_config" in target_cfg else None
    target_cfg = text_config(target_cfg)
    n = len(layer_types)
    head_dim = target_cfg.get("head_dim") or (
        target_cfg["hidden_size"] // target_cfg["num_attention_heads"]
    )
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": model_type or target_cfg.get("model_type", "qwen3"),
        "vocab_size": target_cfg["vocab_size"],
        "hidden_size": target_cfg["hidden_size"],
        "intermediate_size": intermediate_size or target_cfg["intermediate_size"],
        "num_hidden_layers": n,
        "num_attention_heads": num_heads or target_cfg["num_attention_heads"],
        "num_key_value_heads": num_kv_heads or target_cfg["num_key_value_heads"],
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": target_cfg.get("max_position_embeddings", 4096),
        "rms_norm_eps": target_cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": target_cfg.get("rope_theta", 10000.0),
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "float32",
        "block_size": block_size,
        "num_target_layers": target_cfg["num_hidden_layers"],
        "dflash_config": {
            "mask_token_id": mask_token_id,
            "target_layer_ids": list(target_layer_ids),
        },
        "layer_types": list(layer_types),
        "use_sliding_window": sliding_window is not None,
        "sliding_window": sliding_window,
    }
    if sliding_window is not None:
        cfg["max_window_layers"] = n
    return cfg


def load_target(target_dir: Path) -> torch.nn.Module:
    """The target in float32 with transformers. Multimodal wrappers (Qwen3.5/3.6
    hybrids: ``text_config`` + a vision tower) load as image-text-to-text models:
    text-only calls run the language model, ``hidden_states`` are its layers'."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    auto = AutoModelForImageTextToText if "text_config" in cfg else AutoModelForCausalLM
    return auto.from_pretrained(
        target_dir, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()


def text_config(target_cfg: dict) -> dict:
    """The language model's config (the wrapper's ``text_config`` if any)."""
    return target_cfg.get("text_config", target_cfg)


def build_corpora(
    target: torch.nn.Module,
    drafter_cfg: dict,
    data_cfg: DataConfig,
    vocab_end: int | None = None,
) -> tuple[Corpus, Corpus]:
    """(training corpus, held-out corpus) for this drafter's target layers.

    Prompt tokens are drawn from ``mask_token_id + 1 .. vocab_end - 1``
    (default: the whole vocabulary); a multimodal target's vision special
    tokens sit above ``vocab_end``."""
    vocab = vocab_end or drafter_cfg["vocab_size"]
    layer_ids = list(drafter_cfg["dflash_config"]["target_layer_ids"])
    mask_id = int(drafter_cfg["dflash_config"]["mask_token_id"])
    # Prompts avoid the special ids up to the mask token (pad/bos/eos/mask).
    token_range = (mask_id + 1, vocab)
    train_set = build_corpus(
        target, layer_ids, data_cfg.num_sequences, data_cfg.prompt_lengths,
        data_cfg.new_tokens, token_range, data_cfg.seed,
    )  # fmt: skip
    held_out = build_corpus(
        target, layer_ids, data_cfg.eval_sequences, data_cfg.prompt_lengths,
        data_cfg.new_tokens, token_range, data_cfg.seed + 1_000_003,
    )  # fmt: skip
    return train_set, held_out


def train_drafter(
    target_dir: Path,
    out_dir: Path,
    drafter_cfg: dict,
    train_cfg: TrainConfig | None = None,
    data_cfg: DataConfig | None = None,
    log=print,
    corpora: tuple[Corpus, Corpus] | None = None,
    vocab_end: int | None = None,
) -> dict:
    """Train, evaluate (simulated greedy acceptance) and save; returns the report.

    ``corpora`` (from build_corpora) lets drafters that read the same target
    layers share one generated corpus."""
    from safetensors.torch import save_file

    train_cfg = train_cfg or TrainConfig()
    data_cfg = data_cfg or DataConfig()
    torch.manual_seed(train_cfg.seed)
    t0 = time.monotonic()
    target = load_target(Path(target_dir))
    block = int(drafter_cfg["block_size"])
    corpus, held_out = corpora or build_corpora(
        target, drafter_cfg, data_cfg, vocab_end
    )
    t_data = time.monotonic() - t0
    log(f"corpus: {tuple(corpus.tokens.shape)} tokens ({t_data:.1f}s)")
    model = TrainableDrafter(
        drafter_cfg,
        target.get_input_embeddings().weight.detach().float(),
        target.get_output_embeddings().weight.detach().float(),
    )
    history = train(model, corpus, block, train_cfg, log=log)
    sim = simulate_acceptance(model, held_out, block)
    log(f"held-out simulated acceptance length {sim['acceptance_length']:.3f}")

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        model.checkpoint_state(),
        str(out_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (out_dir / "config.json").write_text(json.dumps(drafter_cfg, indent=1))
    report = {
        "target": str(target_dir),
        "train": train_cfg.as_dict(),
        "data": {**data_cfg.__dict__, "prompt_lengths": list(data_cfg.prompt_lengths)},
        "history": history,
        "held_out": sim,
        "seconds": round(time.monotonic() - t0, 1),
        "torch": torch.__version__,
    }
    (out_dir / "training.json").write_text(json.dumps(report, indent=1))
    return report


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m vllm_dflash.training", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layer-types", default="full_attention,full_attention")
    ap.add_argument("--target-layer-ids", type=_ints, required=True)
    ap.add_argument("--block-size", type=int, default=8)
    ap.add_argument("--mask-token-id", type=int, required=True)
    ap.add_argument("--sliding-window", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--num-sequences", type=int, default=DataConfig.num_sequences)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target_cfg = json.loads((args.target / "config.json").read_text())
    cfg = drafter_config_for(
        target_cfg,
        args.layer_types.split(","),
        args.target_layer_ids,
        args.block_size,
        args.mask_token_id,
        args.sliding_window,
    )
    report = train_drafter(
        args.target,
        args.out,
        cfg,
        TrainConfig(seed=args.seed, steps=args.steps),
        DataConfig(num_sequences=args.num_sequences, seed=args.seed),
    )
    print(json.dumps({"out": str(args.out), "held_out": report["held_out"]}))


if __name__ == "__main__":
    main()
