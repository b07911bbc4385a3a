# SPDX-License-Identifier: Apache-2.0
"""Draft cost vs context length: sliding-window drafter vs the same drafter on
full attention (dummy weights, one GPU).

    python benchmarks/gpu/swa_context.py {swa|full} OUT.jsonl [--contexts 1024,32768,65536,32768x4]

Drafter shaped like z-lab/Qwen3.6-27B-DFlash: 5 layers, layer_types
[sliding x4, full], window 2048 (public reports: spiritbuun/Qwen3.6-27B-DFlash-GGUF
card, Luce-Org/lucebox#129), target_layer_ids [1, 16, 31, 46, 61], mask 248070,
hidden 5120, 32 heads / 8 KV heads of 128, intermediate 17408 (sizes inferred
from the 3.3 GB F16 GGUF: ~1.7 B parameters). ``full`` is the same drafter with
every layer on full attention. The target is Qwen3-shaped with 64 layers and
hidden 5120 (so the drafter sees the right feature width) but a small MLP:
target time is not what this measures. Per context ``C`` (or ``CxB``: B requests
of C tokens at once), the prompts are prefilled once (1 output token, untimed) and
then generated again, 64 tokens each: the prefix cache holds the context (target
and drafter KV), so the timed steps are decode steps of B requests at context C.
VLLM_DFLASH_PROFILE gives the draft sections' mean milliseconds per drafting step
(device-synchronised).
"""

import argparse
import json
import os
import random
import time

VOCAB = 248320
TARGET = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 5120,
    "intermediate_size": 1024, "num_hidden_layers": 64, "num_attention_heads": 40,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": VOCAB,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 10000000,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "attention_bias": False, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
LAYER_TYPES = ["sliding_attention"] * 4 + ["full_attention"]
DRAFTER = dict(
    TARGET, architectures=["DFlashDraftModel"], num_hidden_layers=5,
    intermediate_size=17408, num_attention_heads=32, num_key_value_heads=8,
    block_size=16, num_target_layers=64, layer_types=LAYER_TYPES,
    use_sliding_window=True, sliding_window=2048, max_window_layers=5,
    dflash_config={"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
)  # fmt: skip


def write_models(root: str, variant: str) -> tuple[str, str]:
    drafter = dict(DRAFTER)
    if variant == "full":
        drafter.update(layer_types=["full_attention"] * 5, use_sliding_window=False)
        drafter.pop("sliding_window")
        drafter.pop("max_window_layers")
    paths = {"target": TARGET, f"draft-{variant}": drafter}
    for name, cfg in paths.items():
        os.makedirs(f"{root}/{name}", exist_ok=True)
        with open(f"{root}/{name}/config.json", "w") as fh:
            json.dump(cfg, fh)
    return f"{root}/target", f"{root}/draft-{variant}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variant", choices=["swa", "full"])
    ap.add_argument("out")
    ap.add_argument("--contexts", default="1024,8192,32768,65536,1024x4,32768x4")
    ap.add_argument("--root", default="/root/q36")
    ap.add_argument("--k", type=int, default=15)
    args = ap.parse_args()
    prof = f"{args.root}/profile-{args.variant}.json"
    os.environ["VLLM_DFLASH_PROFILE"] = prof
    target, drafter = write_models(args.root, args.variant)
    contexts = [
        (int(c.split("x")[0]), int(c.split("x")[1]) if "x" in c else 1)
        for c in args.contexts.split(",")
    ]
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(
        model=target, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
        max_model_len=max(c for c, _ in contexts) + 256, gpu_memory_utilization=0.85, seed=0,
        max_num_seqs=max(b for _, b in contexts), max_num_batched_tokens=8192,
        speculative_config={"method": "dflash", "model": drafter,
                            "num_speculative_tokens": args.k},
    )  # fmt: skip
    init_s = time.time() - t0
    rng = random.Random(0)
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, detokenize=False)

    def prompt(n: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(1000, 200000) for _ in range(n)]}

    llm.generate([prompt(256)], sp, use_tqdm=False)  # warm-up
    prefill = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
    for ctx, nreq in contexts:
        batch = [prompt(ctx) for _ in range(nreq)]
        llm.generate(batch, prefill, use_tqdm=False)  # fills the prefix cache
        if os.path.exists(prof):
            os.remove(prof)
        t1 = time.time()
        llm.generate(batch, sp, use_tqdm=False)
        dt = time.time() - t1
        with open(prof) as fh:
            p = json.load(fh)
        ms = p["mean_ms"]
        # Draft sections are means over drafting steps only (see profile.py).
        rec = {
            "variant": args.variant, "context": ctx, "batch": nreq, "init_s": round(init_s, 1),
            "mean_batch": p["mean_batch"], "cudagraph_dispatch": p.get("cudagraph_dispatch"),
            "gen_s": round(dt, 3), "steps": p["steps"], "draft_steps": p["draft_steps"],
            "draft_ms": round(sum(v for k, v in ms.items()
                                  if k.startswith("draft_") or k == "context_kv"), 4),
            "sections_ms": ms,
        }  # fmt: skip
        print("RESULT", json.dumps(rec), flush=True)
        with open(args.out, "a") as fh:
            fh.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
