# SPDX-License-Identifier: Apache-2.0
"""Acceptance length and output tokens/s of the trained tiny DFlash drafters on
vLLM's CPU backend, DFlash vs no speculation, through ``vllm serve``.

    python benchmarks/cpu_acceptance.py --out /tmp/cpu-acceptance

Writes OUT/acceptance.json (and OUT/acceptance.png when matplotlib is
installed). Configurations: no speculation; dense drafter; dense with the
#40727 backport disabled; sliding-window drafter; sliding-window drafter with
the #40898 backport disabled (stock vLLM 0.20.1 runs its windows as full
attention). Every DFlash run's output is compared with the no-spec output.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_dflash.testing.acceptance import serve_and_measure  # noqa: E402
from vllm_dflash.testing.trained import ensure_trained_models  # noqa: E402
from vllm_dflash.training.data import synthetic_prompts  # noqa: E402

CONFIGS = [  # name, drafter, disabled patches
    ("no-spec", None, ()),
    ("dense", "dense", ()),
    ("dense-stock40727", "dense", ("dflash_aux_layer_shift",)),
    ("swa", "swa", ()),
    ("swa-stock40898", "swa", ("dflash_sliding_window",)),
]


def held_out_prompts(n: int = 16) -> list[list[int]]:
    """Not in the training corpus (different seed)."""
    return synthetic_prompts(n, (5, 40), (4, 512), seed=12345)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    models = ensure_trained_models()
    prompts = held_out_prompts(args.num_prompts)
    runs = {}
    for name, drafter, disable in CONFIGS:
        run = serve_and_measure(
            name, models.target, prompts,
            drafter=getattr(models, drafter) if drafter else None,
            disable=disable, max_tokens=args.max_tokens,
            concurrency=args.concurrency, log_dir=args.out,
        )  # fmt: skip
        runs[name] = run
        print(f"{name:18s} acceptance {run.acceptance_length}  "
              f"{run.tokens_per_s:.1f} tok/s", flush=True)  # fmt: skip
    base = runs["no-spec"].outputs
    result = {
        "machine": f"{platform.machine()} {platform.processor()} ({platform.node()})",
        "cpus": len(__import__("os").sched_getaffinity(0)),
        "vllm": subprocess.run(
            [sys.executable, "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
        ).stdout.strip(),  # fmt: skip
        "command": "python benchmarks/cpu_acceptance.py --out " + str(args.out),
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "num_speculative_tokens": 7,
        "training": {w: models.report(w)["held_out"] for w in ("dense", "swa")},
        "runs": {
            n: {**r.as_dict(), "lossless": r.outputs == base} for n, r in runs.items()
        },
    }
    (args.out / "acceptance.json").write_text(json.dumps(result, indent=1))
    try:
        import matplotlib  # noqa: F401

        subprocess.run([sys.executable, str(ROOT / "benchmarks/plot_results.py"), str(args.out)],
                       check=False)  # fmt: skip
    except ImportError:
        print("matplotlib not installed: no PNG (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
