# SPDX-License-Identifier: Apache-2.0
"""A trained DFlash drafter for a tiny Qwen3.5/3.6-shaped hybrid target.

The random drafter of ``tiny_hybrid`` never gets a draft accepted, so the
target's speculative verify after an accepted draft (Gated-DeltaNet state
roll-forward with ``num_accepted_tokens > 1``, per-token state slots, the conv
window, M-RoPE positions of accepted tokens after an image) would go untested.

The random ``tiny_hybrid.HYBRID`` target's greedy continuations are chaotic (a
tiny drafter trained on them stays near acceptance length 1), so the target
here is a variant with the same architecture (``Qwen3_5ForConditionalGeneration``,
``[GDN x3, gated attention] x 2``, M-RoPE, the vision tower, the same shapes)
and other random weights: small attention / GDN weights and larger per-token
MLPs (as ``trained.TRAINED_TARGET`` for the dense pair), so most greedy tokens
follow from the current token and the rest from its recent context (GDN conv
and state, attention). The drafter has the shape of ``tiny_hybrid.HYBRID_DRAFTER``
(``[sliding, sliding, full]``, window 6, block 8, target layer ids (1, 3, 6):
GDN, gated attention, GDN) and is trained with ``vllm_dflash.training`` on the
target's greedy continuations of random text prompts (seeded, one torch thread:
about 6 minutes on a busy 2-core machine).

The target is built from its seed (seconds); a checkout ships only the drafter
(``fixtures/trained-hybrid/``, about 2 MB) with the fingerprint of every
setting below and the SHA-256 of the target weights it was trained on. When
either does not match (a setting changed, or this transformers builds other
target weights), the drafter is trained once and cached under
``VLLM_DFLASH_FIXTURES`` (or ~/.cache/vllm-dflash/fixtures).

Usage: ``python -m vllm_dflash.testing.trained_hybrid [OUT_DIR]`` trains into
OUT_DIR (``--ship`` refreshes ``fixtures/trained-hybrid/`` from the run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path

import torch

from vllm_dflash.testing.tiny_hybrid import (
    HYBRID_VERSION,
    IMAGE_ID,
    HybridSpec,
    TinyHybrid,
    build_hybrid_target,
    text_spec,
)
from vllm_dflash.testing.tiny_models import (
    MASK_ID,
    DrafterSpec,
    _fingerprint,
    default_cache_dir,
    drafter_config,
)
from vllm_dflash.training.pipeline import DataConfig, train_drafter
from vllm_dflash.training.recipe import TrainConfig

TRAINING_VERSION = "1"
# Attention and GDN weights 0.02, MLPs 0.3: about 80% of the greedy tokens are
# what the current token alone gives (1% for HYBRID), the rest depend on context.
TRAINED_HYBRID_TARGET = HybridSpec(seed=20, init_std=0.02)
TARGET_MLP_STD = 0.3
TRAINED_HYBRID_DRAFTER = DrafterSpec(
    name="trained-hybrid",
    layer_types=("sliding_attention", "sliding_attention", "full_attention"),
    target_layer_ids=(1, 3, 6),  # GDN, gated attention, GDN
    block_size=8,
    sliding_window=6,
)
TRAIN = TrainConfig(seed=0, steps=1000)
# Prompt tokens below the vision special tokens (504..507), as in the tests.
DATA = DataConfig(num_sequences=512, eval_sequences=32, new_tokens=56, seed=0)
VOCAB_END = IMAGE_ID

SHIPPED = Path(__file__).resolve().parents[2] / "fixtures" / "trained-hybrid"


def fingerprint() -> str:
    return _fingerprint(
        TRAINING_VERSION, HYBRID_VERSION, _target_key(), TRAINED_HYBRID_DRAFTER,
        TRAIN, DATA, VOCAB_END,
    )  # fmt: skip


def _target_key() -> tuple[HybridSpec, float]:
    return TRAINED_HYBRID_TARGET, TARGET_MLP_STD


def weights_sha256(model_dir: Path) -> str:
    return hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()


def _stamp(target: Path) -> dict:
    return {"fingerprint": fingerprint(), "target_sha256": weights_sha256(target)}


def _target(cache_dir: Path | None) -> Path:
    root = (cache_dir or default_cache_dir()) / (
        "trained-hybrid-target-" + _fingerprint(HYBRID_VERSION, _target_key())
    )
    if not (root / ".complete").exists():
        build_hybrid_target(root / "target", TRAINED_HYBRID_TARGET, TARGET_MLP_STD)
        (root / ".complete").write_text("ok\n")
    return root / "target"


def _matches(drafter_root: Path, target: Path) -> bool:
    stamp = drafter_root / "fingerprint.json"
    return stamp.exists() and json.loads(stamp.read_text()) == _stamp(target)


def ensure_trained_hybrid(
    cache_dir: Path | None = None, log=print, train: bool = False
) -> TinyHybrid:
    """The hybrid target (built from its seed) and the trained drafter: the
    shipped one if it was trained on exactly this target with these settings,
    else one trained once (``train=True``: always) and cached."""
    target = _target(cache_dir)
    if not train and _matches(SHIPPED, target):
        return TinyHybrid(
            root=SHIPPED, target=target, drafter=SHIPPED / TRAINED_HYBRID_DRAFTER.name
        )
    root = (cache_dir or default_cache_dir()) / f"trained-hybrid-{fingerprint()}"
    models = TinyHybrid(
        root=root, target=target, drafter=root / TRAINED_HYBRID_DRAFTER.name
    )
    if _matches(root, target) and (root / ".complete").exists():
        return models
    # One thread: the hybrid's per-token GDN steps are small ops; with two
    # threads on a busy 2-core machine the corpus took 10x longer (141 s vs 13 s
    # for 64 sequences).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(models, log)
    finally:
        torch.set_num_threads(threads)


def _train(models: TinyHybrid, log) -> TinyHybrid:
    root, target = models.root, models.target
    cfg = drafter_config(TRAINED_HYBRID_DRAFTER, text_spec(TRAINED_HYBRID_TARGET))
    assert cfg["dflash_config"]["mask_token_id"] == MASK_ID
    log(f"training {TRAINED_HYBRID_DRAFTER.name} for the tiny hybrid target ...")
    t0 = time.monotonic()
    report = train_drafter(
        target, models.drafter, cfg, TRAIN, DATA, log=log, vocab_end=VOCAB_END
    )
    build = {
        "seconds": report["seconds"],
        "total_s": round(time.monotonic() - t0, 1),
        "threads": torch.get_num_threads(),
        "held_out": report["held_out"],
    }
    (root / "build.json").write_text(json.dumps(build, indent=1))
    (root / "fingerprint.json").write_text(json.dumps(_stamp(target), indent=1))
    (root / ".complete").write_text("ok\n")
    return models


def report(models: TinyHybrid) -> dict:
    return json.loads((models.drafter / "training.json").read_text())


def ship(models: TinyHybrid) -> None:
    """Refresh fixtures/trained-hybrid/ (drafter, training report, stamp)."""
    if SHIPPED.exists():
        shutil.rmtree(SHIPPED)
    shutil.copytree(models.drafter, SHIPPED / models.drafter.name)
    for name in ("build.json", "fingerprint.json"):
        shutil.copy(models.root / name, SHIPPED / name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", type=Path, default=None)
    ap.add_argument(
        "--ship", action="store_true", help="copy the trained drafter to fixtures/"
    )
    args = ap.parse_args()
    models = ensure_trained_hybrid(args.out, train=True)
    if args.ship:
        ship(models)
    print(json.dumps({k: str(v) for k, v in models.__dict__.items()}, indent=1))
    r = report(models)
    print(json.dumps({"held_out": r["held_out"], "seconds": r["seconds"]}))


if __name__ == "__main__":
    main()
