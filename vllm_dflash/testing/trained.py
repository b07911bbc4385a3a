# SPDX-License-Identifier: Apache-2.0
"""Trained tiny DFlash drafters: a real, repeatable acceptance signal on CPU.

A tiny Qwen3 target (random weights: small attention, larger per-token MLPs,
so its greedy continuations are mostly predictable and consecutive layers'
features differ) and two drafters trained to imitate it with
``vllm_dflash.training`` (seeded, ~2-4 minutes each on 2 CPU cores):

* ``dense``: 2 full-attention layers;
* ``swa``: 2 sliding-window layers (window 8, shorter than most contexts) + 1 full.

Both read target layers (0, 1) (layer 0's large MLP makes its output differ
from the embeddings, so reading one layer too early -- stock vLLM 0.20.x without
#40727 -- hands the drafter features it was not trained on) and draft blocks of
8 (k = 7). A checkout ships the three checkpoints in ``fixtures/trained/`` (about
7 MB, with the fingerprint of every spec and training setting below), so tests
and the demo do not spend ~7 minutes training them; when the fingerprint no
longer matches (a setting changed), they are trained once and cached under
``VLLM_DFLASH_FIXTURES`` (or ~/.cache/vllm-dflash/fixtures).

Usage: ``python -m vllm_dflash.testing.trained [OUT_DIR]`` trains into OUT_DIR
(``--ship`` refreshes ``fixtures/trained/`` from a training run).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_dflash.testing.tiny_models import (
    MASK_ID,
    DrafterSpec,
    TargetSpec,
    _fingerprint,
    build_target,
    default_cache_dir,
    drafter_config,
)
from vllm_dflash.training.pipeline import (
    DataConfig,
    build_corpora,
    load_target,
    train_drafter,
)
from vllm_dflash.training.recipe import TrainConfig

TRAINING_VERSION = "2"
TRAINED_TARGET = TargetSpec(init_std=0.05, mlp_std=0.3, seed=0)
TRAINED_DENSE = DrafterSpec(
    name="trained-dense",
    layer_types=("full_attention", "full_attention"),
    target_layer_ids=(0, 1),
    block_size=8,
)
TRAINED_SWA = DrafterSpec(
    name="trained-swa",
    layer_types=("sliding_attention", "sliding_attention", "full_attention"),
    target_layer_ids=(0, 1),
    block_size=8,
    sliding_window=8,
)
TRAIN = TrainConfig(seed=0, steps=2000)
DATA = DataConfig(num_sequences=1024, eval_sequences=32, new_tokens=88, seed=0)


@dataclass(frozen=True)
class TrainedModels:
    root: Path
    target: Path
    dense: Path
    swa: Path

    def report(self, which: str) -> dict:
        return json.loads((getattr(self, which) / "training.json").read_text())

    def build_times(self) -> dict:
        return json.loads((self.root / "build.json").read_text())


SHIPPED = Path(__file__).resolve().parents[2] / "fixtures" / "trained"


def fingerprint() -> str:
    return _fingerprint(
        TRAINING_VERSION, TRAINED_TARGET, TRAINED_DENSE, TRAINED_SWA, TRAIN, DATA
    )


def _models(root: Path) -> TrainedModels:
    return TrainedModels(
        root=root,
        target=root / "target",
        dense=root / TRAINED_DENSE.name,
        swa=root / TRAINED_SWA.name,
    )


def shipped_models() -> TrainedModels | None:
    """The checkpoints shipped in the checkout, if they match these settings."""
    stamp = SHIPPED / "fingerprint"
    if stamp.exists() and stamp.read_text().strip() == fingerprint():
        return _models(SHIPPED)
    return None


def ensure_trained_models(
    cache_dir: Path | None = None, log=print, train: bool = False
) -> TrainedModels:
    """The shipped checkpoints, else build the target and train both drafters
    once (``train=True``: always train, into ``cache_dir``); return their paths."""
    if not train and (shipped := shipped_models()) is not None:
        return shipped
    models = _models((cache_dir or default_cache_dir()) / f"trained-{fingerprint()}")
    root = models.root
    if (root / ".complete").exists():
        return models
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
    build_target(models.target, TRAINED_TARGET)
    assert TRAINED_DENSE.target_layer_ids == TRAINED_SWA.target_layer_ids
    corpora = None  # generated once, shared (same target layers)
    t0 = time.monotonic()
    timings = {}
    for spec, out in ((TRAINED_DENSE, models.dense), (TRAINED_SWA, models.swa)):
        cfg = drafter_config(spec, TRAINED_TARGET)
        assert cfg["dflash_config"]["mask_token_id"] == MASK_ID
        if corpora is None:
            log("generating the training corpus (target greedy continuations) ...")
            corpora = build_corpora(load_target(models.target), cfg, DATA)
            timings["corpus_s"] = round(time.monotonic() - t0, 1)
        log(f"training {spec.name} ...")
        report = train_drafter(
            models.target, out, cfg, TRAIN, DATA, log=log, corpora=corpora
        )
        timings[f"{spec.name}_s"] = report["seconds"]
    timings["total_s"] = round(time.monotonic() - t0, 1)
    timings["threads"] = torch.get_num_threads()
    (root / "build.json").write_text(json.dumps(timings, indent=1))
    (root / ".complete").write_text("ok\n")
    return models


def ship(models: TrainedModels) -> None:
    """Refresh fixtures/trained/ (weights, configs, tokenizer, training reports)."""
    import shutil

    if SHIPPED.exists():
        shutil.rmtree(SHIPPED)
    for src in (models.target, models.dense, models.swa):
        shutil.copytree(src, SHIPPED / src.name)
    shutil.copy(models.root / "build.json", SHIPPED / "build.json")
    (SHIPPED / "fingerprint").write_text(fingerprint() + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", type=Path, default=None)
    ap.add_argument(
        "--ship", action="store_true", help="copy the trained checkpoints to fixtures/"
    )
    args = ap.parse_args()
    models = ensure_trained_models(args.out, train=True)
    if args.ship:
        ship(models)
    print(json.dumps({k: str(v) for k, v in models.__dict__.items()}, indent=1))
    for which in ("dense", "swa"):
        r = models.report(which)
        print(which, json.dumps({"held_out": r["held_out"], "seconds": r["seconds"]}))


if __name__ == "__main__":
    main()
