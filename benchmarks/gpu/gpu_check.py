# SPDX-License-Identifier: Apache-2.0
"""GPU correctness check of vllm-dflash (vLLM 0.20.1, CUDA).

    python benchmarks/gpu/gpu_check.py --out DIR [--runs a,b] [--budget S] [--jobs N]
    python benchmarks/gpu/gpu_check.py --merge DIR1/gpu_check.json DIR2/gpu_check.json --out DIR

Builds the head_dim-128 tiny fixtures (the Qwen3 pair of tiny_models and the
Qwen3.5-shaped hybrid pair of tiny_hybrid, each only if a selected run uses it),
runs one engine per configuration (``RUNS``: no speculation, DFlash dense, DFlash
sliding-window; eager and CUDA graphs; bf16 and fp32; each backport disabled in
turn; tensor parallel 2; the hybrid target with its sliding + full drafter, text
prompts, prefix caching off), then judges them (``evaluate``) and writes
DIR/gpu_check.json with the run data and every check:

  * starts       the engine ran (runs with ``expect_fail`` must not: a refusal or
                 a stock-vLLM defect);
  * backend      bf16 runs use FlashAttention (fp32: the backend vLLM picked);
  * lossless     greedy DFlash output == the non-speculative run of the same mode,
                 except divergences that the float64 target calls near-ties;
  * drafts       traced drafts == the float64 PyTorch reference (bf16: near-ties
                 excused; fp32: exact);
  * kv_window    sliding drafter layers attend with window W and keep full-size KV;
  * stock_defect with a backport disabled the drafts fall far from the reference.

Single-GPU runs spread over the visible GPUs (``--jobs``, one engine per GPU at a
time); tensor-parallel runs come last. Exit status 0 when every check of the runs
that ran holds. ``--merge`` joins reports of runs split over several device calls.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from queue import Queue

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu import gdn_backend  # noqa: E402

NEAR_TIE = 0.01  # logit gap below 1% of the float64 logit range


@dataclass(frozen=True)
class Run:
    name: str
    drafter: str | None = None  # "dense" | "swa" | None (no speculation)
    eager: bool = True
    disable: str = ""  # VLLM_DFLASH_DISABLE; "*" loads no plugin at all (stock)
    tp: int = 1
    dtype: str = "bfloat16"
    expect_fail: str = ""  # why this run must not start (a documented refusal/defect)
    fail_pattern: str = ""  # regex the failing run's log must match
    max_num_seqs: int = 32
    # Which fixture pair: "dense" (Qwen3 target; drafters "dense"/"swa") or "hybrid"
    # (Qwen3.5-shaped GDN + gated-attention target, M-RoPE, vision tower; its one
    # drafter, sliding + full layers, is named "swa"). Hybrid runs are text-only,
    # prefix caching off (DFlash + prefix caching on a hybrid target is refused).
    fixtures: str = "dense"
    # A disabled fix whose stock defect is a wrong token (not a lower draft match):
    # the run must diverge from no speculation by more than a near-tie.
    defect_wrong_token: bool = False
    # Hybrid targets: "torch" runs the GDN prefill on the plugin's float32 chunked
    # rule (run_llm.py --gdn-prefill-backend torch, uni-process): vLLM's FLA and
    # FlashInfer prefills are bf16/fp16 only. "": vLLM's choice (gdn_backend.py).
    gdn_prefill: str = ""
    # Hybrid runs keep prefix caching off unless this is set (then explicitly on:
    # vLLM 0.20.1 leaves it off for hybrid targets by default; on, it picks mamba
    # cache mode 'align'). The batches share prompts (prompts(1) and prompts(8) open
    # prompts(32)), so batches 8 and 32 hit the prefix cache.
    prefix_caching: bool = False
    # Prompts of at least this many tokens (run_llm.py --min-prompt-len); a run with
    # longer prompts has its own no-speculation run ("-long" in its name).
    min_prompt_len: int = 8
    # "adaptive": speculative_config draft_length; ``schedule``: the per-step
    # lengths it verifies in turn (VLLM_DFLASH_DRAFT_LENGTH_SCHEDULE: every
    # transition, including steps that verify nothing, under CUDA graphs).
    draft_length: str = ""
    schedule: str = ""

    @property
    def base(self) -> str:
        """The non-speculative run with the same fixtures, mode, dtype and TP size."""
        mode = "eager" if self.eager else "graph"
        tp = f"-tp{self.tp}" if self.tp > 1 else ""
        dt = "-fp32" if self.dtype == "float32" else ""
        pre = "hybrid-" if self.fixtures == "hybrid" else ""
        long = "-long" if self.min_prompt_len > 8 else ""
        return f"{pre}base-{mode}{dt}{tp}{long}"

    @property
    def plugin_counterpart(self) -> str | None:
        """For a run with one backport disabled: the same run with the plugin whole."""
        if not self.disable or self.disable == "*":
            return None
        return self.name.rsplit("-stock", 1)[0]


RUNS = [
    Run("base-eager"),
    Run("dense-eager", "dense"),
    Run("swa-eager", "swa"),
    Run("dense-eager-stock40727", "dense", disable="dflash_aux_layer_shift"),
    Run("swa-eager-stock40898", "swa", disable="dflash_sliding_window"),
    Run("base-graph", eager=False),
    Run("dense-graph", "dense", eager=False),
    Run("swa-graph", "swa", eager=False),
    # fp32: FlashAttention has no fp32 kernels; vLLM picks another backend.
    Run("base-eager-fp32", dtype="float32"),
    Run("dense-eager-fp32", "dense", dtype="float32"),
    # Sliding layers on FLEX_ATTENTION: 89.0% = reference while they shared the full
    # layer's metadata builder (window-pruned block masks); own builder since 2026-11-30.
    Run("swa-eager-fp32", "swa", dtype="float32"),
    # #50065: 33 sequences x (1 + k=7) = 264 query tokens; the dispatcher pads the
    # drafter batch to the capture size 272. Stock 0.20.1 (patch disabled) started
    # and ran here too (short slices stay silent on FLASH_ATTN), so no stock run.
    Run("dense-graph-seqs33", "dense", eager=False, max_num_seqs=33),
    # Tensor parallel (2 GPUs): drafter heads split across ranks, fc replicated.
    Run("base-graph-tp2", eager=False, tp=2),
    Run("dense-graph-tp2", "dense", eager=False, tp=2),
    Run("swa-graph-tp2", "swa", eager=False, tp=2),
    # Stock vLLM (no plugin): cannot start DFlash at TP=2 with CUDA graphs.
    Run("dense-graph-tp2-noplugin", "dense", eager=False, disable="*", tp=2,
        expect_fail="stock vLLM 0.20.1: custom all-reduce crash in graph capture",
        fail_pattern=r"custom_all_reduce|illegal memory access"),
    # Qwen3.5/3.6-shaped hybrid target (Gated-DeltaNet + gated attention, M-RoPE)
    # with a sliding + full drafter: text prompts, batches 1/8/32 like every run.
    Run("hybrid-base-eager", fixtures="hybrid"),
    Run("hybrid-swa-eager", "swa", fixtures="hybrid"),
    Run("hybrid-swa-eager-stock40727", "swa", disable="dflash_aux_layer_shift", fixtures="hybrid"),
    Run("hybrid-swa-eager-stock40898", "swa", disable="dflash_sliding_window", fixtures="hybrid"),
    Run("hybrid-base-graph", eager=False, fixtures="hybrid"),
    Run("hybrid-swa-graph", "swa", eager=False, fixtures="hybrid"),
    # vllm#49918: prompt 0 has 8 = 1 + k tokens; stock vLLM replays the verify FULL
    # graph for its prefill and its GDN state is never built (wrong first token).
    Run("hybrid-swa-graph-stockalias", "swa", eager=False, fixtures="hybrid",
        disable="dflash_prefill_not_uniform_decode", defect_wrong_token=True),
    # float32 (the drafter on FLEX_ATTENTION over the hybrid K/V-interleaved cache:
    # dflash_flex_hybrid_kv_layout): no bf16 rounding between the verify and decode
    # paths, so lossless and drafts are judged exactly.
    Run("hybrid-base-eager-fp32", fixtures="hybrid", dtype="float32", gdn_prefill="torch"),
    Run("hybrid-swa-eager-fp32", "swa", fixtures="hybrid", dtype="float32", gdn_prefill="torch"),
    Run("hybrid-base-graph-fp32", eager=False, fixtures="hybrid", dtype="float32", gdn_prefill="torch"),
    Run("hybrid-swa-graph-fp32", "swa", eager=False, fixtures="hybrid", dtype="float32", gdn_prefill="torch"),
    # DFlash + prefix caching on a hybrid target (mamba cache mode 'align'). fp32
    # (exact: any divergence beyond a near-tie is a wrong token), prompts of
    # 640..729 tokens: the hybrid block is 304 tokens on the GPU, and a DFlash
    # prefix-cache hit drops its last matched block (as for EAGLE), so it needs two
    # (prompts of 320..409 tokens had 0 hits: H100, 2026-12-06).
    Run("hybrid-swa-eager-fp32-long-prefixcache", "swa", fixtures="hybrid",
        dtype="float32", gdn_prefill="torch", min_prompt_len=640, prefix_caching=True),
    Run("hybrid-base-eager-fp32-long", fixtures="hybrid", dtype="float32",
        gdn_prefill="torch", min_prompt_len=640),
    # bf16 with FULL CUDA graphs and the adaptive draft length: the configuration of
    # the 27B-shaped chat engine (its start-up crash: dflash_gdn_zero_draft_decodes).
    # bf16 is not bit-identical on the hybrid pair (verify vs decode rounding: its
    # lossless check fails at logit gaps of 1-2% of the range), so the
    # prefix-caching run is read against the same engine without prefix caching:
    # divergences of the same size, drafts vs the float64 reference alike.
    Run("hybrid-base-graph-long", eager=False, fixtures="hybrid", min_prompt_len=640),
    Run("hybrid-swa-graph-long-adaptive", "swa", eager=False, fixtures="hybrid",
        min_prompt_len=640, draft_length="adaptive"),
    Run("hybrid-swa-graph-long-prefixcache-adaptive", "swa", eager=False, fixtures="hybrid",
        min_prompt_len=640, prefix_caching=True, draft_length="adaptive"),
    # Adaptive draft length with a forced schedule of lengths (7/4 = k): full, short
    # and empty verifies, context-only drafter passes, with CUDA graphs.
    Run("dense-graph-adaptive", "swa", eager=False, draft_length="adaptive",
        schedule="7,0,0,3,1,5,0,2"),
    Run("hybrid-swa-graph-fp32-adaptive", "swa", eager=False, fixtures="hybrid",
        dtype="float32", gdn_prefill="torch", draft_length="adaptive",
        schedule="7,0,0,3,1,5,0,2"),
    Run("hybrid-swa-eager-fp32-long-prefixcache-stock", "swa", fixtures="hybrid",
        dtype="float32", gdn_prefill="torch", min_prompt_len=640, prefix_caching=True,
        disable="hybrid_align_budget_check", defect_wrong_token=True),
]  # fmt: skip
BY_NAME = {r.name: r for r in RUNS}


@dataclass(frozen=True)
class Fixtures:
    """The checkpoints of both fixture pairs (a pair no selected run uses: None)."""

    dense: object | None = None  # tiny_models.TinyModels
    hybrid: object | None = None  # tiny_hybrid.TinyHybrid

    def target(self, run: Run) -> Path:
        return getattr(self, run.fixtures).target

    def drafter(self, run: Run) -> Path:
        pair = getattr(self, run.fixtures)
        return pair.drafter if run.fixtures == "hybrid" else getattr(pair, run.drafter)


def build_fixtures(root: Path, runs: list[Run]) -> tuple[Fixtures, dict[str, str]]:
    """The pairs the runs use, and why a pair could not be built (its runs are
    then reported as skipped, the others still run): e.g. a transformers
    without Qwen3.5 for the hybrid pair."""
    from vllm_dflash.testing.tiny_models import ensure_gpu_tiny_models

    def hybrid(root: Path):
        from vllm_dflash.testing.tiny_hybrid import ensure_gpu_tiny_hybrid

        return ensure_gpu_tiny_hybrid(root)

    built, errors = {}, {}
    for kind, ensure in (("dense", ensure_gpu_tiny_models), ("hybrid", hybrid)):
        if any(r.fixtures == kind for r in runs):
            try:
                built[kind] = ensure(root)
            except Exception as e:
                errors[kind] = f"{kind} fixtures not built: {type(e).__name__}: {e}"
                print(f"[gpu_check] {errors[kind]}", flush=True)
    return Fixtures(**built), errors


# ----------------------------------------------------------------------------- runs
def run_one(
    run: Run, models: Fixtures, out: Path, timeout: float, gpus: str | None
) -> dict:
    res_file, trace = out / f"{run.name}.json", out / f"{run.name}.trace.jsonl"
    cmd = [sys.executable, str(ROOT / "benchmarks/gpu/run_llm.py"),
           "--target", str(models.target(run)), "--out", str(res_file), "--dtype", run.dtype]  # fmt: skip
    if run.drafter:
        cmd += ["--drafter", str(models.drafter(run))]
    if run.fixtures == "hybrid":
        cmd += [
            "--mm-limit",
            "0",
            "--prefix-caching" if run.prefix_caching else "--no-prefix-caching",
        ]
        # vLLM picks FlashInfer's GDN prefill on Hopper: kept when flashinfer can run
        # it (the carried prebuilt module), else triton (gdn_backend.py; GDN_PREFILL)
        gdn = run.gdn_prefill or gdn_backend.choose()
        if gdn:
            cmd += ["--gdn-prefill-backend", gdn]
    if run.eager:
        cmd.append("--eager")
    if run.tp > 1:
        cmd += ["--tp", str(run.tp)]
    if run.max_num_seqs != 32:
        cmd += ["--max-num-seqs", str(run.max_num_seqs)]
    if run.min_prompt_len > 8:
        # 512 - 32 sequences x 6 draft slots = 320 >= the 304-token block: prefills
        # are cut at block boundaries, where 'align' mode keeps the GDN state (a
        # prompt prefilled in one chunk leaves none: the H200 run of 2026-12-01 had
        # 320 prefix-cache queries and 0 hits)
        cmd += [
            "--min-prompt-len",
            str(run.min_prompt_len),
            "--max-num-batched-tokens",
            "512",
        ]
    if SHARED_GPU_KV_GIB:
        cmd += ["--kv-cache-gib", str(SHARED_GPU_KV_GIB)]
    if run.draft_length:
        cmd += ["--draft-length", run.draft_length]
    cmd += RUN_LLM_ARGS
    env = dict(os.environ)
    if run.schedule:
        env["VLLM_DFLASH_DRAFT_LENGTH_SCHEDULE"] = run.schedule
    if not run.defect_wrong_token:  # judged by its tokens alone: no drafts to replay
        env["VLLM_DFLASH_TRACE"] = str(trace)
    env["VLLM_DFLASH_DISABLE"] = "" if run.disable == "*" else run.disable
    if run.disable == "*":
        env["VLLM_PLUGINS"] = ""  # load no general plugin: stock vLLM
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    t0 = time.time()
    try:
        p = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout
        )
        rc, log = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out_s = (
            e.stdout.decode(errors="replace")
            if isinstance(e.stdout, bytes)
            else e.stdout
        )
        rc, log = -9, f"TIMEOUT {timeout:.0f}s\n{out_s or ''}"
    (out / f"{run.name}.log").write_text(log)
    backends = sorted(
        {
            ln.split("Using ")[1].split(" ")[0]
            for ln in log.splitlines()
            if "Using " in ln and "backend" in ln
        }
    )
    res = {"rc": rc, "wall_s": round(time.time() - t0, 1), "backends": backends}
    if run.fixtures == "hybrid":  # the GDN prefill kernel vLLM logged
        res["gdn_prefill"] = gdn_backend.from_log(log)
    return {**res,
            "expected_failure_seen": bool(run.fail_pattern)
            and re.search(run.fail_pattern, log) is not None}  # fmt: skip


def visible_gpus() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env:
        return [g for g in env.split(",") if g]
    try:
        lines = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True
        ).stdout
    except OSError:
        return []
    return [str(i) for i, ln in enumerate(lines.splitlines()) if ln.startswith("GPU ")]


SHARED_GPU_KV_GIB = 0.0  # set by --slots-per-gpu > 1
RUN_LLM_ARGS: list[str] = []  # --run-llm-args (dry runs on CPU)


def execute(
    runs: list[Run],
    models: Fixtures,
    out: Path,
    budget: float,
    jobs: int,
    per_gpu: int = 1,
) -> dict:
    """Single-GPU runs on a pool of GPU slots (``per_gpu`` engines share a GPU, each
    with a fixed KV cache so no engine's memory profiling sees another's memory),
    then multi-GPU runs one at a time."""
    t_start, results = time.time(), {}
    gpus = visible_gpus() or ["0"]
    slots: Queue[str] = Queue()
    for _ in range(max(1, per_gpu)):
        for i in range(max(1, min(jobs, len(gpus)))):
            slots.put(gpus[i])
    if jobs > slots.qsize():  # JOBS=4 on one GPU once ran one engine at a time
        print(f"[gpu_check] --jobs {jobs} but {len(gpus)} GPU(s) x {per_gpu} slot(s): "
              f"{slots.qsize()} engine(s) at a time (more per GPU: --slots-per-gpu, SLOTS=)",
              flush=True)  # fmt: skip

    def go(run: Run, gpu: str | None) -> None:
        left = budget - (time.time() - t_start) - 30
        if left < 45:
            results[run.name] = {"rc": None, "skipped": "time budget"}
            return
        results[run.name] = r = run_one(run, models, out, min(left, 300), gpu)
        print(
            f"[gpu_check] {run.name}: rc={r['rc']} {r['wall_s']:.0f}s {r['backends']}"
            + (f" gdn_prefill={r['gdn_prefill']}" if "gdn_prefill" in r else ""),
            flush=True,
        )

    def single(run: Run) -> None:
        gpu = slots.get()
        try:
            go(run, gpu)
        finally:
            slots.put(gpu)

    with ThreadPoolExecutor(max_workers=slots.qsize()) as pool:
        list(pool.map(single, [r for r in runs if r.tp == 1]))
    for run in (r for r in runs if r.tp > 1):
        if run.tp > len(gpus):
            results[run.name] = {"rc": None, "skipped": f"needs {run.tp} GPUs"}
            continue
        go(run, ",".join(gpus[: run.tp]))
    return results


# ------------------------------------------------------------------------ analysis
def _load_run(out: Path, name: str) -> tuple[dict | None, list[dict]]:
    res, trace = out / f"{name}.json", out / f"{name}.trace.jsonl"
    data = json.loads(res.read_text()) if res.exists() else None
    records = (
        [json.loads(x) for x in trace.read_text().splitlines()]
        if trace.exists()
        else []
    )
    return data, records


def compare_drafts(ref, data: dict, trace: list[dict]) -> dict:
    """Traced drafts vs the float64 reference drafting from the same tokens
    (tests/helpers/equivalence.compare over all batches of the run)."""
    from tests.helpers.equivalence import compare

    flat: dict[str, list] = {"request_ids": [], "prompts": [], "outputs": []}
    for b in data["batches"].values():
        for key in flat:
            flat[key] += b[key]
    st = compare(ref, flat, trace, near_tie=NEAR_TIE)
    return {"drafts": st.drafts, "tokens": st.tokens,
            "exact_match_rate": st.token_rate,
            "match_rate_excusing_near_ties": st.rate_excusing_near_ties}  # fmt: skip


def divergences(target, base: dict, spec: dict) -> list[dict]:
    """First differing token of every sequence where spec != base, scored by the
    float64 target: the gap between the two tokens relative to its logit range."""
    import torch

    rows = []
    for bs, b in base["batches"].items():
        s = spec["batches"][bs]
        for p, x, y in zip(b["prompts"], b["outputs"], s["outputs"], strict=True):
            if x == y:
                continue
            i = next(j for j, (u, v) in enumerate(zip(x, y, strict=True)) if u != v)
            with torch.no_grad():
                logits = target(torch.tensor([p + x[:i]])).logits[0, -1]
            gap = float(logits[x[i]] - logits[y[i]])
            rows.append({"batch": bs, "position": i, "base_token": x[i], "spec_token": y[i],
                         "float64_argmax": int(logits.argmax()),
                         "gap_rel_range": round(abs(gap) / float(logits.max() - logits.min()), 6)})  # fmt: skip
    return rows


def lossless(base: dict, spec: dict) -> dict:
    out = {}
    for bs, b in base["batches"].items():
        s = spec["batches"][bs]
        same = sum(x == y for x, y in zip(b["outputs"], s["outputs"], strict=True))
        out[bs] = f"{same}/{len(b['outputs'])}"
    return out


def analyse(job: tuple[str, str, str, str]) -> dict:
    """One run's comparisons (own process: the float64 reference is CPU work)."""
    name, out_dir, target_dir, drafter_dir = job
    import torch

    from tests.helpers.reference import Reference

    torch.set_num_threads(2)
    torch.set_default_device("cpu")
    out, run = Path(out_dir), BY_NAME[name]
    data, trace = _load_run(out, name)
    base, _ = _load_run(out, run.base)
    ref = Reference.load(Path(target_dir), Path(drafter_dir))
    entry: dict = {}
    if base is not None:
        entry["lossless"] = lossless(base, data)
        entry["divergences"] = divergences(ref.target, base, data)
    if trace:
        try:
            entry["drafts_vs_reference"] = compare_drafts(ref, data, trace)
        except AssertionError as e:  # a misaligned trace: the other checks stand
            entry["drafts_vs_reference"] = {"error": str(e)}
    return entry


def kv_window_ok(
    run: Run, kv: dict, window: int | None, sliding_layers: int = 0
) -> tuple[bool, str]:
    """As many windowed drafter layers as the drafter config has sliding layers,
    every drafter layer's KV a FullAttentionSpec."""
    if not kv:
        return False, "no KV report"
    windowed = [n for n, v in kv.items() if v["window"] not in (None, -1, [-1, -1])]
    specs = sorted({v["kv_spec"] for v in kv.values()})
    ok = len(windowed) == sliding_layers and specs == ["FullAttentionSpec"]
    return (
        ok,
        f"windowed layers {len(windowed)}/{len(kv)} (window {window}), KV specs {specs}",
    )


def evaluate(report: dict) -> list[dict]:
    """Every check that the runs present allow; each {check, run, ok, detail}."""
    runs, checks = report["runs"], []

    def add(check: str, name: str, ok: bool, detail: str) -> None:
        checks.append({"check": check, "run": name, "ok": bool(ok), "detail": detail})

    for name, r in runs.items():
        run = BY_NAME[name]
        if r.get("skipped"):
            add("starts", name, False, f"skipped: {r['skipped']}")
            continue
        if run.expect_fail:
            seen = r.get("expected_failure_seen", False)
            add("starts", name, r["rc"] != 0 and seen,
                f"rc={r['rc']}, log {'matches' if seen else 'does NOT match'} "
                f"/{run.fail_pattern}/ (expected to fail: {run.expect_fail})")  # fmt: skip
            continue
        add("starts", name, r["rc"] == 0, f"rc={r['rc']}")
        if r["rc"] != 0:
            continue
        if run.dtype == "bfloat16":
            add("backend", name, "FLASH_ATTN" in r["backends"], f"{r['backends']}")
        want = (report.get("gdn_prefill") or {}).get("expected")
        if (
            run.fixtures == "hybrid"
            and want
            and r.get("gdn_prefill")
            and not run.gdn_prefill
        ):
            add("gdn_prefill", name, r["gdn_prefill"] == want,
                f"vLLM logged {r['gdn_prefill']}, expected {want}")  # fmt: skip
        if not run.drafter:
            continue
        if run.defect_wrong_token:
            div = r.get("divergences", [])
            bad = [d for d in div if d["gap_rel_range"] > NEAR_TIE]
            add("stock_defect", name, bool(bad),
                f"{len(bad)} wrong tokens with {run.disable} disabled (first: {bad[:2]})")  # fmt: skip
            continue
        if "lossless" in r:
            div = r["divergences"]
            bad = [d for d in div if d["gap_rel_range"] > NEAR_TIE]
            add("lossless", name, not bad,
                f"identical {r['lossless']}; divergent sequences: {len(div)}, all near-ties"
                if not bad else f"{len(bad)} divergences are not near-ties: {bad[:3]}")  # fmt: skip
        d = r.get("drafts_vs_reference")
        if d is None or "error" in d:
            add("drafts", name, False, d["error"] if d else "no traced drafts")
            continue
        counterpart = run.plugin_counterpart
        if counterpart:
            good = runs.get(counterpart, {}).get("drafts_vs_reference")
            if good:
                bad_rate, good_rate = (
                    d["match_rate_excusing_near_ties"],
                    good["match_rate_excusing_near_ties"],
                )
                add("stock_defect", name, bad_rate <= good_rate - 0.3,
                    f"{bad_rate:.3f} with {run.disable} disabled vs {good_rate:.3f} in {counterpart}")  # fmt: skip
            continue
        rate_key = (
            "exact_match_rate"
            if run.dtype == "float32"
            else "match_rate_excusing_near_ties"
        )
        add("drafts", name, d["drafts"] >= 200 and d[rate_key] >= 0.95,
            f"{d['drafts']} drafts, exact {d['exact_match_rate']:.4f}, "
            f"excusing near-ties {d['match_rate_excusing_near_ties']:.4f} (needs {rate_key} >= 0.95)")  # fmt: skip
        ok, detail = kv_window_ok(
            run, r.get("kv") or {}, r.get("window"), r.get("sliding_layers", 0)
        )
        add(
            "kv_window",
            name,
            ok,
            detail if ok or "kv" in r else f"{detail}: {r.get('kv_error')}",
        )
    return checks


def build_report(runs: dict[str, dict], out: Path, models: Fixtures) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    report = {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
              "gdn_prefill": gdn_backend.describe(), "runs": {}}  # fmt: skip
    # vLLM's auto choice: FlashInfer on sm90 only (ChunkGatedDeltaRule)
    sm90 = cuda and torch.cuda.get_device_capability(0) == (9, 0)
    report["gdn_prefill"]["expected"] = report["gdn_prefill"]["passed"] or (
        "flashinfer" if sm90 else "triton"
    )
    jobs = []
    for name, r in runs.items():
        entry = dict(r)
        data, _ = _load_run(out, name) if r.get("rc") == 0 else (None, [])
        if data:
            entry.update(
                spec_decode=data["spec_decode"], init_s=round(data["init_s"], 1)
            )
            for key in ("kv", "kv_error"):
                if key in data:
                    entry[key] = data[key]
            run = BY_NAME[name]
            if run.drafter:
                drafter_dir = models.drafter(run)
                cfg = json.loads((drafter_dir / "config.json").read_text())
                entry["window"] = cfg.get("sliding_window")
                entry["sliding_layers"] = (cfg.get("layer_types") or []).count(
                    "sliding_attention"
                )
                jobs.append((name, str(out), str(models.target(run)), str(drafter_dir)))
        report["runs"][name] = entry
    workers = max(1, min(len(jobs), (os.cpu_count() or 2) // 2))
    # spawn: this process may hold a CUDA context, which forked workers must not inherit
    with ProcessPoolExecutor(
        max_workers=workers, mp_context=get_context("spawn")
    ) as pool:
        for (name, *_), extra in zip(jobs, pool.map(analyse, jobs), strict=True):
            report["runs"][name].update(extra)
    return report


def finish(report: dict, out: Path) -> int:
    report["checks"] = evaluate(report)
    report["passed"] = all(c["ok"] for c in report["checks"])
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    for c in report["checks"]:
        print(
            f"[gpu_check] {'PASS' if c['ok'] else 'FAIL'} {c['check']:<12} {c['run']:<26} {c['detail']}"
        )
    print(f"[gpu_check] {'PASSED' if report['passed'] else 'FAILED'}: "
          f"{sum(c['ok'] for c in report['checks'])}/{len(report['checks'])} checks")  # fmt: skip
    return 0 if report["passed"] else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=540)
    ap.add_argument("--models", type=Path, default=Path("/root/vllm-dflash-fixtures"))
    ap.add_argument("--runs", default="", help="comma-separated subset of run names")
    ap.add_argument(
        "--jobs", type=int, default=8, help="single-GPU engines at once (<= GPUs)"
    )
    ap.add_argument(
        "--slots-per-gpu",
        type=int,
        default=1,
        help="engines sharing one GPU (tiny models; each gets a fixed 2 GiB KV cache)",
    )
    ap.add_argument(
        "--merge", type=Path, nargs="+", help="join these gpu_check.json reports"
    )
    ap.add_argument(
        "--run-llm-args", default="",
        help="appended to every run_llm.py command (a CPU dry run: "
        "'--batch-sizes 1,4 --max-tokens 12 --dtype float32')",
    )  # fmt: skip
    ap.add_argument(
        "--reanalyse", action="store_true",
        help="judge the engine outputs already in --out (runs.json, outputs, traces: "
        "e.g. brought back from a GPU call whose time ran out during the analysis); "
        "starts no engine, any machine",
    )  # fmt: skip
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.reanalyse:
        results = json.loads((args.out / "runs.json").read_text())
        runs = [BY_NAME[name] for name in results]
        models, _ = build_fixtures(args.models, runs)
        return finish(build_report(results, args.out, models), args.out)
    if args.merge:
        report = {"device": None, "runs": {}}
        for path in args.merge:
            part = json.loads(path.read_text())
            report["device"] = report["device"] or part["device"]
            report.setdefault("gdn_prefill", part.get("gdn_prefill"))
            report["runs"].update(part["runs"])
        return finish(report, args.out)
    wanted = set(filter(None, args.runs.split(",")))
    unknown = wanted - set(BY_NAME)
    if unknown:
        ap.error(f"--runs: unknown run(s) {sorted(unknown)}; known: {list(BY_NAME)}")
    runs = [r for r in RUNS if not wanted or r.name in wanted]
    models, fixture_errors = build_fixtures(args.models, runs)
    global SHARED_GPU_KV_GIB, RUN_LLM_ARGS
    RUN_LLM_ARGS = args.run_llm_args.split()
    if args.slots_per_gpu > 1:
        SHARED_GPU_KV_GIB = 2.0
    results = execute(
        [r for r in runs if r.fixtures not in fixture_errors],
        models, args.out, args.budget, args.jobs, args.slots_per_gpu,
    )  # fmt: skip
    for r in runs:
        if r.fixtures in fixture_errors:
            results[r.name] = {"rc": None, "skipped": fixture_errors[r.fixtures]}
    results = {r.name: results[r.name] for r in runs}  # RUNS order
    # the engines' part of the report, kept before the (CPU-heavy) float64 analysis
    (args.out / "runs.json").write_text(json.dumps(results, indent=1))
    return finish(build_report(results, args.out, models), args.out)


if __name__ == "__main__":
    sys.exit(main())
