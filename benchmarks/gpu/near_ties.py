# SPDX-License-Identifier: Apache-2.0
"""Are lossless-check divergences bf16 near-ties? (runs on the CPU)

    python benchmarks/gpu/near_ties.py CHECK_DIR BASE_RUN SPEC_RUN

For every sequence where the speculative run's greedy output differs from the
non-speculative run (run JSONs written by gpu_check.py), take the first
differing position and score both candidate tokens with the float64 target:
the gap between them, relative to the target's logit range there. A gap far
below bf16 resolution (~0.4% of the range) means either token is a valid
greedy choice for a bf16 model: a near-tie flip, not a speculative-decoding error.
gpu_check.py makes the same analysis for every run (``divergences``); this
re-runs it for one pair of saved runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("check_dir", type=Path)
    ap.add_argument("base")
    ap.add_argument("spec")
    ap.add_argument(
        "--models", type=Path, default=Path("/tmp/vllm-dflash-gpu-fixtures")
    )
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from benchmarks.gpu.gpu_check import divergences
    from vllm_dflash.testing.tiny_models import ensure_gpu_tiny_models

    models = ensure_gpu_tiny_models(args.models)
    target = AutoModelForCausalLM.from_pretrained(
        models.target, dtype=torch.float64, attn_implementation="eager"
    ).eval()
    base = json.loads((args.check_dir / f"{args.base}.json").read_text())
    spec = json.loads((args.check_dir / f"{args.spec}.json").read_text())
    rows = divergences(target, base, spec)
    print(
        json.dumps(
            {"base": args.base, "spec": args.spec, "divergences": rows}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
