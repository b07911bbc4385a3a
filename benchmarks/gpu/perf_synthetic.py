# SPDX-License-Identifier: Apache-2.0
"""DFlash throughput on one GPU with synthetic acceptance (dummy weights).

    python benchmarks/gpu/perf_synthetic.py MODE OUT.jsonl [--conc 1,4,16,64]

MODE: ``base`` (no speculation), ``stock`` (DFlash, vllm-dflash not loaded:
VLLM_PLUGINS set to nothing), ``plugin`` (DFlash with vllm-dflash), ``adaptive``
(the same with ``"draft_length": "adaptive"``), ``adaptive-fullhead`` (adaptive
without dflash_partial_draft_head: the draft head over all k positions, as
measured on 2026-12-01), ``adaptive-reserve`` (adaptive without dflash_full_step_budget: vLLM's
step budget, k drafting slots per sequence reserved), ``adaptive-nojit`` (adaptive
without dflash_jit_warmup: the spec-decode kernels compile while serving, as
before that patch; each DFlash run writes OUT.jit-MODE-TAG.jsonl, the variants its workers
compiled after their start-up warm-up), ``prev`` (the plugin without the
hybrid patches of issue #16: dflash_hybrid_no_accepted_sync, dflash_gdn_shared_metadata,
dflash_gdn_state_replay; what was measured before them, 2026-12-01). Same setup as
shared/gpu/exp/perf_synthetic.py, which measured stock 0.20.1: a Qwen3-8B-shaped
target, a drafter shaped like z-lab/Qwen3-8B-DFlash-b16 (5 layers, target ids
[1,9,17,25,33], block 16), bf16, CUDA graphs, 512-token prompts, 1024 output
tokens, greedy, k=15, rejection_sample_method synthetic, acceptance length 6.35.
One engine per process; all concurrencies run on it. Per concurrency, one untimed
warm-up batch of the same size (first-use kernels, graph sizes), then ``--repeats``
timed batches (one JSON record each, ``rep`` 0..N-1).
"""

import argparse
import json
import os
import random
import statistics
import time

TARGET = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
}  # fmt: skip
DRAFTER = dict(
    TARGET, architectures=["DFlashDraftModel"], num_hidden_layers=5, block_size=16,
    num_target_layers=36, dflash_config={"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
)  # fmt: skip


# --pair hybrid: the Qwen3.6-27B-shaped hybrid target (Gated-DeltaNet + gated
# attention, M-RoPE, vision tower; text prompts) and the drafter shaped like
# z-lab/Qwen3.6-27B-DFlash (4 sliding + 1 full layers, block 16).
SHAPES = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "..",
    "..",
    "fixtures",
    "shapes",
    "qwen3.6-27b",
)


def pair_configs(pair: str) -> tuple[dict, dict]:
    if pair == "dense":
        return TARGET, DRAFTER
    with open(os.path.join(SHAPES, "target-config.json")) as fh:
        target = json.load(fh)
    with open(os.path.join(SHAPES, "drafter-config.json")) as fh:
        drafter = json.load(fh)
    return target, drafter


def write_models(root: str, pair: str = "dense") -> None:
    for name, cfg in zip(("target", "draft"), pair_configs(pair), strict=True):
        os.makedirs(f"{root}/{name}", exist_ok=True)
        with open(f"{root}/{name}/config.json", "w") as fh:
            json.dump(cfg, fh)


def engine_kwargs(
    mode: str,
    root: str,
    tau: float,
    max_num_seqs: int,
    tp: int = 1,
    pair: str = "dense",
    kv_cache_gib: float = 0.0,
    max_model_len: int = 4096,
    enforce_eager: bool = False,
    gpu_util: float = 0.85,
    cudagraph_mode: str = "",
) -> dict:
    """``vllm.LLM`` arguments of MODE's engine (``base``: no speculation)."""
    spec = None
    if mode != "base":
        spec = {
            "method": "dflash", "model": f"{root}/draft", "num_speculative_tokens": 15,
            "rejection_sample_method": "synthetic", "synthetic_acceptance_length": tau,
        }  # fmt: skip
        if mode.startswith("adaptive"):
            spec["draft_length"] = "adaptive"
    extra = {}
    if pair == "hybrid":
        import sys

        sys.path.insert(
            0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
        )
        from benchmarks.gpu import gdn_backend

        # DFlash + prefix caching is refused on hybrid targets: off in both modes
        extra = dict(
            enable_prefix_caching=False, limit_mm_per_prompt={"image": 0, "video": 0}
        )
        gdn = gdn_backend.choose()  # vLLM's FlashInfer where it can run, else triton
        if gdn:
            extra["gdn_prefill_backend"] = gdn
    if cudagraph_mode:  # e.g. PIECEWISE: what a DFlash step of d < k drafts gets
        extra["compilation_config"] = {"cudagraph_mode": cudagraph_mode}
    return dict(
        model=f"{root}/target", load_format="dummy", skip_tokenizer_init=True,
        dtype="bfloat16", max_model_len=max_model_len, gpu_memory_utilization=gpu_util,
        speculative_config=spec, seed=0, max_num_seqs=max_num_seqs,
        tensor_parallel_size=tp, kv_cache_memory_bytes=int(kv_cache_gib * 2**30) or None,
        enforce_eager=enforce_eager,
        **extra,
    )  # fmt: skip


# The hybrid patches of issue #16; ``prev`` disables them.
ISSUE16_PATCHES = (
    "dflash_hybrid_no_accepted_sync",
    "dflash_gdn_shared_metadata",
    "dflash_gdn_state_replay",
)


class Turns:
    """Engines of several processes on one GPU that take turns (``--turn``).

    Each process starts its engine and runs its first warm-up request, then
    waits until every peer is that far (no compile, autotune or graph capture
    of one engine overlaps a batch of another); afterwards each batch waits for
    its turn: peers run their batches alternately, one at a time, so a ratio of
    two engines is measured side by side on the same machine state."""

    def __init__(self, spec: str, me: str, tag: str = "") -> None:
        path, _, names = spec.partition(":")
        # one folder per round (--tag): files of an earlier round never count
        self.dir, self.peers = os.path.join(path, tag or "round"), names.split(",")
        if me not in self.peers:
            raise SystemExit(f"--turn {spec}: mode {me} is not one of the peers")
        self.me = self.peers.index(me)
        os.makedirs(self.dir, exist_ok=True)

    def _file(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def _left(self, i: int) -> bool:
        """Peer ``i`` finished, or its process is gone (killed by a time limit:
        no ``leave``)."""
        if os.path.exists(self._file(f"left-{i}")):
            return True
        try:
            with open(self._file(f"ready-{i}")) as fh:
                os.kill(int(fh.read()), 0)
        except (FileNotFoundError, ValueError):
            return False  # not ready yet
        except ProcessLookupError:
            return True
        return False

    def ready(self) -> None:
        tmp = self._file(f"ready-{self.me}.tmp")
        with open(tmp, "w") as fh:
            fh.write(str(os.getpid()))
        os.replace(tmp, self._file(f"ready-{self.me}"))
        while not all(
            os.path.exists(self._file(f"ready-{i}")) or self._left(i)
            for i in range(len(self.peers))
        ):
            time.sleep(0.05)

    def _turn(self) -> int:
        try:
            with open(self._file("turn")) as fh:
                return int(fh.read() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def _set_turn(self, value: int) -> None:
        tmp = self._file(f"turn.{self.me}")
        with open(tmp, "w") as fh:
            fh.write(str(value))
        os.replace(tmp, self._file("turn"))

    def run(self, fn):
        while True:
            t = self._turn()
            owner = t % len(self.peers)
            if owner == self.me:
                break
            if self._left(owner):  # a peer that finished (or died) passes
                self._set_turn(t + 1)
                continue
            time.sleep(0.05)
        try:
            return fn()
        finally:
            self._set_turn(t + 1)

    def leave(self) -> None:
        open(self._file(f"left-{self.me}"), "w").close()

    def wait_all_left(self, timeout: float = 120.0) -> None:
        """Wait (up to ``timeout`` s) until every peer finished: the next round's
        engine start (PERF_TAU=3.5,6.35) never overlaps a peer's timed batch."""
        end = time.time() + timeout
        while time.time() < end and not all(
            self._left(i) for i in range(len(self.peers))
        ):
            time.sleep(0.2)


def spec_counters(llm) -> dict[str, float]:
    """vLLM's spec-decode counters (``vllm:spec_decode_*``) of an engine now."""
    return {
        m.name: m.value
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode") and hasattr(m, "value")
    }


def step_summary(path: str, t0: float, t1: float) -> dict:
    """The engine steps whose output came between wall times t0 and t1, from a
    VLLM_DFLASH_STEP_LOG file: per draft length of the decode-only steps (every
    request one token plus d drafts; "x" where requests verified different
    numbers), the number of steps, their median, slowest and total milliseconds;
    the steps with a prefill chunk ("mixed") in total; and the three slowest steps
    of the batch (ms, kind, requests): a first-use cost (a kernel compiled for a
    new shape) is one slow step, a slower draft length is many."""
    by_d: dict[str, list[float]] = {}
    mixed: list[float] = []
    every: list[tuple[float, str, int]] = []
    try:
        with open(path) as fh:
            lines = [json.loads(line) for line in fh if line.strip()]
    except (OSError, ValueError):
        return {}
    for rec in lines:
        if not t0 < rec["t"] <= t1:
            continue
        if not rec["decode"]:
            mixed.append(rec["ms"])
            every.append((rec["ms"], "mixed", rec["reqs"]))
            continue
        even = rec["drafts"] == rec["dmax"] * rec["reqs"]
        kind = str(rec["dmax"]) if even else "x"
        by_d.setdefault(kind, []).append(rec["ms"])
        every.append((rec["ms"], kind, rec["reqs"]))
    out: dict = {
        "decode": {
            d: {
                "steps": len(v),
                "median_ms": round(statistics.median(v), 3),
                "max_ms": round(max(v), 3),
                "ms": round(sum(v), 1),
            }
            for d, v in sorted(by_d.items())
        },
        "mixed": {"steps": len(mixed), "ms": round(sum(mixed), 1)},
        "slowest": [
            [round(ms, 3), kind, reqs] for ms, kind, reqs in sorted(every)[::-1][:3]
        ],
    }
    return out


def random_prompts(rng: random.Random, n: int) -> list[dict]:
    """N token-id prompts of 512 tokens."""
    return [
        {"prompt_token_ids": [rng.randrange(1000, 100000) for _ in range(512)]}
        for _ in range(n)
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "mode",
        choices=[
            "base",
            "stock",
            "plugin",
            "adaptive",
            "adaptive-fullhead",
            "adaptive-reserve",
            "adaptive-nojit",
            "prev",
        ],  # fmt: skip
    )
    ap.add_argument("out")
    ap.add_argument("--conc", default="1,4,16,64")
    ap.add_argument("--tau", type=float, default=6.35)
    ap.add_argument("--max-tokens", type=int, default=1024, help="output tokens")
    ap.add_argument("--root", default="/root/p8b")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--tag", default="", help="label stored with each record")
    ap.add_argument("--pair", choices=["dense", "hybrid"], default="dense")
    ap.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs (the mode of the first memory numbers: 26.9 / 111.3)",
    )
    ap.add_argument(
        "--kv-cache-gib",
        type=float,
        default=0.0,
        help="fixed KV cache (GiB; 0: vLLM sizes it from gpu_memory_utilization)",
    )
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="the engine logs its max concurrency at this many tokens per request",
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="timed batches per concurrency"
    )
    ap.add_argument(
        "--turn", default=None,
        help="DIR:MODE1,MODE2: engines of these modes, one process each on one GPU, "
        "run their batches alternately (start them together; use --kv-cache-gib)",
    )  # fmt: skip
    ap.add_argument(
        "--gpu-util", type=float, default=0.85,
        help="gpu_memory_utilization (engines that share the GPU: each its part)",
    )  # fmt: skip
    ap.add_argument(
        "--cudagraph-mode", default="",
        help="compilation_config cudagraph_mode (default: vLLM's, FULL_AND_PIECEWISE); "
        "PIECEWISE on a no-spec engine prices the full decode graph",
    )  # fmt: skip
    ap.add_argument(
        "--profile", default=None,
        help="VLLM_DFLASH_PROFILE file: per-section step times (adds device syncs)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    if args.turn and not args.kv_cache_gib:
        # engines that profile their memory at the same time count each other's
        # allocations (H200, 2026-12-02: the second of two 8B engines got 1.27 GiB)
        ap.error("--turn needs --kv-cache-gib (a fixed KV cache for each engine)")
    turns = Turns(args.turn, args.mode, args.tag) if args.turn else None
    try:
        run(args, turns)
    finally:
        if turns:
            turns.leave()
            turns.wait_all_left()


def run(args: argparse.Namespace, turns: "Turns | None") -> None:
    if args.profile:
        os.environ["VLLM_DFLASH_PROFILE"] = args.profile
    if args.mode == "stock":
        os.environ["VLLM_PLUGINS"] = ""  # load no general plugin: stock vLLM
    if args.mode == "prev":
        os.environ["VLLM_DFLASH_DISABLE"] = ",".join(ISSUE16_PATCHES)
    if args.mode == "adaptive-fullhead":  # the first adaptive mode (2026-12-01)
        os.environ["VLLM_DFLASH_DISABLE"] = "dflash_partial_draft_head"
    if args.mode == "adaptive-reserve":  # vLLM's step budget (the 2026-12-03 runs)
        os.environ["VLLM_DFLASH_DISABLE"] = "dflash_full_step_budget"
    if args.mode == "adaptive-nojit":  # kernels compiled while serving
        os.environ["VLLM_DFLASH_DISABLE"] = "dflash_jit_warmup"
    # DFlash workers: one line per Triton variant compiled after their warm-up
    os.environ.setdefault(
        "VLLM_DFLASH_JIT_LOG",
        os.path.abspath(f"{args.out}.jit-{args.mode}-{args.tag}.jsonl"),
    )
    write_models(args.root, args.pair)
    # one line per engine step (no device sync): summarised per timed batch
    steps_path = os.path.abspath(f"{args.out}.steps-{args.mode}-{args.tag}.jsonl")
    os.environ.setdefault("VLLM_DFLASH_STEP_LOG", steps_path)
    steps_path = os.environ["VLLM_DFLASH_STEP_LOG"]
    from vllm import LLM, SamplingParams

    concs = [int(c) for c in args.conc.split(",")]
    t0 = time.time()
    llm = LLM(
        **engine_kwargs(
            args.mode, args.root, args.tau, max(concs), args.tp, args.pair,
            kv_cache_gib=args.kv_cache_gib, max_model_len=args.max_model_len,
            enforce_eager=args.enforce_eager, gpu_util=args.gpu_util,
            cudagraph_mode=args.cudagraph_mode,
        ),
        disable_log_stats=False,
    )  # fmt: skip
    init_s = time.time() - t0
    cache = llm.llm_engine.vllm_config.cache_config
    print(
        "RESULT",
        json.dumps(
            {
                "mode": args.mode,
                "pair": args.pair,
                "tag": args.tag,
                "init_s": round(init_s, 1),
                "max_model_len": args.max_model_len,
                "num_gpu_blocks": cache.num_gpu_blocks,
                "block_size": cache.block_size,
            }  # fmt: skip
        ),
        flush=True,
    )
    rng = random.Random(0)
    warm = SamplingParams(
        temperature=0, max_tokens=32, ignore_eos=True, detokenize=False
    )
    llm.generate(random_prompts(rng, 1), warm)
    if turns:
        turns.ready()

    def in_turn(fn):
        return fn() if turns is None else turns.run(fn)

    if args.profile and os.path.exists(args.profile):
        os.remove(args.profile)  # measure from the first timed request on

    sp = SamplingParams(
        temperature=0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False
    )

    for conc in concs:
        # same batch size, untimed
        warm_prompts = random_prompts(rng, conc)
        in_turn(lambda p=warm_prompts: llm.generate(p, warm, use_tqdm=False))
        if args.profile and os.path.exists(args.profile):
            os.remove(args.profile)
        for rep in range(1 if args.profile else args.repeats):
            prompts = random_prompts(rng, conc)

            def timed(prompts=prompts):
                before = spec_counters(llm)
                t1 = time.time()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                t2 = time.time()
                return outs, t2 - t1, before, spec_counters(llm), (t1, t2)

            outs, dt, before, after, (t1, t2) = in_turn(timed)
            d = {k: after[k] - before.get(k, 0) for k in after}
            ntok = sum(len(o.outputs[0].token_ids) for o in outs)
            drafts = d.get("vllm:spec_decode_num_drafts", 0)
            rec = {
                "max_model_len": args.max_model_len,
                "mode": args.mode, "pair": args.pair, "tp": args.tp, "tag": args.tag, "conc": conc, "rep": rep, "tau": args.tau,
                "init_s": round(init_s, 1), "gen_s": round(dt, 3), "tok_s": round(ntok / dt, 1), "tokens": ntok,
                "acceptance_length": (d.get("vllm:spec_decode_num_accepted_tokens", 0) / drafts + 1) if drafts else None,
            }  # fmt: skip
            if args.cudagraph_mode:
                rec["cudagraph_mode"] = args.cudagraph_mode
            time.sleep(0.05)  # the engine core writes its last step's line
            rec["steps"] = step_summary(steps_path, t1, t2 + 0.05)
            if args.profile and os.path.exists(args.profile):
                with open(args.profile) as fh:
                    rec["profile"] = json.load(fh)
                os.remove(args.profile)  # next concurrency starts a fresh profile
            print("RESULT", json.dumps(rec), flush=True)
            with open(args.out, "a") as fh:
                fh.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
