# SPDX-License-Identifier: Apache-2.0
"""``make demo``: DFlash on vLLM's CPU backend, end to end, in about two minutes.

Builds the tiny fixture models, starts ``vllm serve TARGET --speculative-config
{...dflash...}``, sends completion and chat requests through the OpenAI client,
prints the outputs and the acceptance counters from /metrics, stops the server.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor

from vllm_dflash.testing.server import (
    VllmServer,
    acceptance_length,
    speculative_config_arg,
)
from vllm_dflash.testing.tiny_models import ensure_tiny_models


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", choices=["dense", "swa"], default="swa")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    args = ap.parse_args()

    models = ensure_tiny_models()
    drafter = str(models.swa if args.drafter == "swa" else models.dense)
    print(f"target  {models.target}\ndrafter {drafter}")
    extra = [
        *speculative_config_arg(drafter, args.k),
        "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
        "--max-num-seqs", "8",
    ]  # fmt: skip
    print("starting: vllm serve", models.target, " ".join(extra))
    from openai import OpenAI

    with VllmServer(str(models.target), extra) as srv:
        client = OpenAI(base_url=srv.base_url + "/v1", api_key="none")
        prompts = [
            " ".join(f"<t{4 + (i * 7 + j * 13) % 500}>" for j in range(6 + 5 * i))
            for i in range(6)
        ]

        def complete(p: str) -> str:
            r = client.completions.create(
                model=str(models.target), prompt=p, max_tokens=24, temperature=0
            )
            return r.choices[0].text

        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(complete, prompts))
        for p, o in zip(prompts, outs, strict=True):
            print(f"\nprompt: {p[:60]}...\noutput: {o.strip()[:100]}")
        chat = client.chat.completions.create(
            model=str(models.target),
            messages=[{"role": "user", "content": "<t42> <t43> <t44>"}],
            max_tokens=16,
            temperature=0,
        )
        print("\nchat:", chat.choices[0].message.content)
        counters = srv.metrics()
    print("\nspec decode counters:", json.dumps(counters, indent=1))
    tau = acceptance_length(counters)
    print(f"mean acceptance length: {tau:.2f} tokens/step" if tau else "no drafts?")
    print(
        "(random tiny drafter weights: acceptance is low; see README for trained numbers)"
    )


if __name__ == "__main__":
    main()
