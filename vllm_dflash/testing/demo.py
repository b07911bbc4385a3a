# SPDX-License-Identifier: Apache-2.0
"""``make demo``: DFlash on vLLM's CPU backend, with and without, side by side.

Uses the tiny Qwen3 target and the DFlash drafter trained to imitate it
(``fixtures/trained/``, see vllm_dflash/testing/trained.py). Starts
``vllm serve TARGET`` once without speculation and once with
``--speculative-config '{"method": "dflash", ...}'``, sends the same greedy
completion requests through the OpenAI client (4 at a time), and prints the
outputs, output tokens/s of both, the speedup and DFlash's acceptance length
from vLLM's /metrics. About 3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse

from vllm_dflash.testing.acceptance import serve_and_measure
from vllm_dflash.testing.trained import ensure_trained_models
from vllm_dflash.training.data import synthetic_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", choices=["dense", "swa"], default="dense")
    ap.add_argument("--k", type=int, default=7, help="num_speculative_tokens")
    ap.add_argument("--prompts", type=int, default=16)
    args = ap.parse_args()

    models = ensure_trained_models()
    drafter = models.dense if args.drafter == "dense" else models.swa
    print(f"target  {models.target}\ndrafter {drafter} (trained, block 8)")
    prompts = synthetic_prompts(args.prompts, (5, 40), (4, 512), seed=12345)
    runs = {}
    for name, d in (("no speculation", None), ("DFlash", drafter)):
        print(
            f"\n== vllm serve {models.target.name}"
            + (f" + DFlash k={args.k}" if d else "")
        )
        runs[name] = serve_and_measure(
            name, models.target, prompts, drafter=d, k=args.k
        )
        print(f"   {runs[name].output_tokens} tokens in {runs[name].seconds:.1f} s")
    base, spec = runs["no speculation"], runs["DFlash"]
    print("\nfirst completions (token ids shown as <tN>):")
    for text in spec.outputs[:3]:
        print("  ", text.strip()[:100])
    same = spec.outputs == base.outputs
    print(f"\nsame output as without speculation: {'yes' if same else 'NO'}")
    print(f"{'':22}{'output tok/s':>14}")
    print(f"{'no speculation':22}{base.tokens_per_s:>14.1f}")
    print(
        f"{'DFlash':22}{spec.tokens_per_s:>14.1f}   ({spec.tokens_per_s / base.tokens_per_s:.2f}x)"
    )
    print(f"DFlash acceptance length: {spec.acceptance_length:.2f} tokens per step "
          f"({spec.drafts:.0f} drafts; 1.00 would mean no draft token accepted)")  # fmt: skip
    if not same:
        raise SystemExit("DFlash changed the greedy output: please report this")


if __name__ == "__main__":
    main()
