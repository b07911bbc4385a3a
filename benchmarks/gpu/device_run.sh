#!/usr/bin/env bash
# Entry point for a lent GPU machine (the `run` tool): unpack the carried vLLM
# 0.20.1 bundle, install this plugin next to it, run the given stages.
#   bash benchmarks/gpu/device_run.sh STAGE...   (results under $OUT)
# Stages: gdn (gdn_paths.py: GDN decode kernels alone, vLLM's paths and the plugin's replay; GDN_BATCHES, GDN_REPLAYS=TOKENS:ACCEPTED,..., GDN_NO_VLLM=1), drafter_gemm (drafter_gemm.py: one draft step's GEMMs, bf16 vs fp8 weights; DRAFTER_GEMM_REQUESTS), check (gpu_check.py; RUNS=subset, JOBS=engines at once, SLOTS=engines per GPU: JOBS=4 on one GPU needs SLOTS=4), pytest (pytest -m gpu; RUNS), perf (perf_synthetic.py; PERF_MODES,
# PERF_CONC, PERF_TP, PERF_PAIR=dense|hybrid, PERF_TAU (a comma list: one round per acceptance), PERF_MAX_TOKENS, PERF_REPEATS rounds of PERF_BATCHES timed batches; modes base stock plugin adaptive prev;
# PERF_MAX_MODEL_LEN (the engine logs its max concurrency at it), PERF_KV_GIB, PERF_GPU_UTIL, PERF_CG_MODE (cudagraph_mode, e.g. PIECEWISE),
# PERF_TURN=DIR:MODE1,MODE2 (engines started together on one GPU, e.g. perf:base@0 perf:plugin@0, take turns batch by batch; needs PERF_KV_GIB), PERF_DEADLINE: no new mode after that many seconds), profile (plugin step profile at PERF_CONC),
# swa (swa_context.py: sliding vs full drafter at SWA_CONTEXTS), sampling (sampling_check.py:
# SAMPLING_STAGES of crash,dense,pair,hybrid (default crash,dense,pair; its hybrid is the tiny
# GPU_HYBRID sampling pair), SAMPLING_N), trace (step_trace.py:
# profiler trace of MODEs (base plugin adaptive; TRACE_SCHEDULE: forced draft lengths of adaptive) at TRACE_CONC, TRACE_PAIR=dense|hybrid, per-step GPU busy/idle/phase summary), hybrid
# (hybrid_pair.py: Qwen3.6-27B-shaped pair, DFlash bf16 / fp8 KV, no-spec fp8; HYBRID_STAGES,
# HYBRID_DEADLINE seconds, HYBRID_ARGS extra arguments, e.g. --graphs), serve[:DTYPE]
# (serve_check.py: vllm serve + OpenAI client on the tiny hybrid pair; SERVE_ARGS), prefix
# (prefix_caching_check.py: DFlash + prefix caching on the tiny hybrid pair, fp32),
# prefix_crash (prefix_crash.sh: the open CUDA crash with prefix caching: guarded run + 3 variants; CRASH_TIMEOUT),
# chat (multiturn_chat.py: the 27B-shaped pair on a multi-turn chat workload; CHAT_ARGS),
# serving[:dense|hybrid[/sync|/blocking|/PATCH]] (tests/e2e/test_serving_features.py against GPU servers, float32;
# SERVING_K; /sync: without async scheduling, /blocking: CUDA_LAUNCH_BLOCKING=1, /PATCH: with
# VLLM_DFLASH_DISABLE=PATCH; a variant runs SERVING_VARIANT_K (min_tokens) only),
# sampling_accept[:DTYPE] (tests/e2e/test_sampling_acceptance.py, engines on the GPU),
# serving_probe (serving_probe.py: structured outputs, an invalid regex and logprobs on
# no-spec / no-plugin / synchronous / DFlash servers; PROBE_VARIANTS, PROBE_SERVER_ARGS).
# flashinfer
# (flashinfer_selftest.py: the carried FlashInfer GDN prefill module vs a float64 reference).
# GDN_PREFILL=auto|flashinfer|triton: the GDN prefill kernel of hybrid (Qwen3.5/3.6)
# targets. auto (default): FlashInfer (vLLM's choice on sm90) when
# .gpu-carry/flashinfer-gdn.tar.xz is carried (flashinfer_carry.sh: prebuilt module,
# no nvcc needed), else Triton; flashinfer: the carry is required; triton: it is not
# unpacked (and removed from a warm machine's site dir).
set -uo pipefail
# $OUT brings back at most 8 files: work in $W, return a summary + one log archive.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# A warm machine keeps /tmp between calls: start from an empty work dir so only
# this call's results come back. W_KEEP=1 keeps it: a second invocation in the same
# call (other PERF_* settings) adds its results to the first one's.
W=/tmp/vllm-dflash-gpu; [ -n "${W_KEEP:-}" ] || rm -rf "$W"; mkdir -p "$W"
T0=$(date +%s)
say() { echo "[device $(( $(date +%s) - T0 ))s] $*" | tee -a "$W/device.log"; }
finish() {
  cp "$W/device.log" "$OUT/" 2>/dev/null
  cp "$W/check/gpu_check.json" "$W/perf.jsonl" "$W/doctor.json" "$W/swa.jsonl" \
    "$W/pytest-gpu.xml" "$W/pytest-gpu_check.json" "$W/hybrid.jsonl" "$OUT/" 2>/dev/null
  cp "$W"/trace/summary-*.json "$OUT/" 2>/dev/null
  # the DFlash profiler traces (re-analysable here: step_trace.py --analyse), if they fit
  local t m
  for m in base plugin adaptive; do
    t=$(ls "$W"/trace/trace-$m/*.json.gz 2>/dev/null | head -1)
    [ -n "$t" ] && [ "$(stat -c %s "$t")" -lt 15000000 ] && cp "$t" "$OUT/profiler-trace-$m.json.gz"
  done
  # logs and small results only (no fixtures/weights): under the 16 MiB a file may bring back
  (cd "$W" && find . -type f -size -8M \( -name '*.log' -o -name '*.json' -o -name '*.jsonl' \
     -o -name '*.xml' -o -name '*.txt' \) -not -path '*/models/*' -not -path '*/fixtures/*' -print0 \
     | tar --null -T - -cJf "$OUT/logs.tar.xz") 2>/dev/null
  # a file that always fits: the last lines of every log
  for f in $(cd "$W" && find . -name '*.log' -not -path '*/models/*' | sort); do
    echo "=== $f"; tail -n 40 "$W/$f"
  done > "$OUT/log-tails.txt" 2>/dev/null
}
trap finish EXIT
if [ ! -d /root/site/vllm ]; then
  cat .gpu-carry/vllm-site.tar.xz.* | xz -dc | tar -x -C /root || { say "unpack failed"; exit 1; }
  python3 -m compileall -q -j 16 /root/site >/dev/null 2>&1
  say "bundle unpacked"
fi
export PYTHONPATH=/root/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# Triton keeps its autotuning results on disk: the second engine of a call (and of a
# warm machine) skips the GDN kernels' autotuning in its start-up.
export TRITON_CACHE_AUTOTUNING=${TRITON_CACHE_AUTOTUNING:-1}
# FlashInfer (GDN prefill only): a site-dir overlay with the prebuilt sm90a module.
export GDN_PREFILL=${GDN_PREFILL:-auto}
FI_TAR=.gpu-carry/flashinfer-gdn.tar.xz
rm -rf /root/site/flashinfer /root/site/flashinfer_python-*.dist-info  # a warm machine's
case $GDN_PREFILL in
  auto|flashinfer)
    if [ -f "$FI_TAR" ]; then
      tar -xJf "$FI_TAR" -C /root/site && python3 -m compileall -q -j 16 /root/site/flashinfer >/dev/null 2>&1
      say "flashinfer carry unpacked: $(head -1 /root/site/flashinfer/data/aot/BUILD-INFO.txt 2>/dev/null)"
      # only the prebuilt module may load: any other flashinfer JIT build fails at
      # once (MissingJITCacheError) instead of looking for nvcc
      export FLASHINFER_DISABLE_JIT=1
    elif [ "$GDN_PREFILL" = flashinfer ]; then
      say "GDN_PREFILL=flashinfer but $FI_TAR is not carried"; exit 1
    fi ;;
  triton) ;;
  *) say "GDN_PREFILL=$GDN_PREFILL: expected auto, flashinfer or triton"; exit 1 ;;
esac
# Never NVLink multicast on the lent hosts (shared GPUs): keep it off everywhere.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The plugin's entry point must be discoverable: install its metadata into the site dir.
python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /root/site . \
  >"$W/pip.log" 2>&1 || { say "plugin install failed"; cat "$W/pip.log"; exit 1; }
# The installed copy looks for the shipped trained checkpoints two levels above its
# package (vllm_dflash/testing/trained.py: SHIPPED = /root/site/fixtures/trained):
# without this link, scripts run from benchmarks/gpu/ import /root/site/vllm_dflash
# and train the drafters again (~3 min).
[ -e /root/site/fixtures ] || ln -s "$PWD/fixtures" /root/site/fixtures
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$W/device.log"
if [ -z "${SKIP_DOCTOR:-}" ]; then
  python3 -m vllm_dflash.entrypoints.cli.main doctor --json > "$W/doctor.json" 2>"$W/doctor.err"; say "doctor rc=$?"
fi
say "GDN prefill: $(python3 -c 'import sys; sys.path.insert(0, "."); from benchmarks.gpu import gdn_backend as g; print(g.describe())' 2>&1 | tail -1)"
run_stage() {  # STAGE[:ARG]  (ARG: perf mode(s) or swa variant, e.g. perf:stock)
  local stage=${1%%:*} arg=""
  [[ $1 == *:* ]] && arg=${1#*:}
  local gpu=${CUDA_VISIBLE_DEVICES:-all}
  case $stage in
    check)
      timeout "${CHECK_TIMEOUT:-560}" python3 benchmarks/gpu/gpu_check.py --out "$W/check" --budget "${BUDGET:-500}" \
        --runs "${RUNS:-}" --jobs "${JOBS:-8}" --slots-per-gpu "${SLOTS:-1}" > "$W/check.log" 2>&1
      say "check rc=$?"; grep '^\[gpu_check\]' "$W/check.log" | cut -c1-260 ;;
    pytest)  # the user-facing form of the check: pytest -m gpu (RUNS: GPU_CHECK_RUNS); pytest:PATH
      GPU_CHECK_OUT="$W/pytest-gpu" GPU_CHECK_RUNS=${RUNS:-} timeout "${CHECK_TIMEOUT:-560}" python3 -m pytest -m gpu "${arg:-tests/gpu}" \
        -p no:cacheprovider --junitxml "$W/pytest-gpu.xml" > "$W/pytest-gpu.log" 2>&1
      say "pytest -m gpu rc=$?"; tail -15 "$W/pytest-gpu.log"
      cp "$W/pytest-gpu/gpu_check.json" "$W/pytest-gpu_check.json" 2>/dev/null ;;
    perf)
      # PERF_TAU may list acceptances (3.5,6.35): a fresh engine per acceptance, each
      # round its own --tag (and so its own turn folder)
      local tau tag taus=${PERF_TAU:-6.35}
      for rep in $(seq 1 "${PERF_REPEATS:-1}"); do
       for tau in ${taus//,/ }; do
        tag=rep$rep; [[ $taus == *,* ]] && tag=rep$rep-tau$tau
        [ -n "${PERF_CG_MODE:-}" ] && tag=$tag-${PERF_CG_MODE,,}
        for mode in ${arg:-${PERF_MODES:-base stock plugin}}; do
          local log="$W/perf-$mode-tp${PERF_TP:-1}-$tag-gpu$gpu.log"
          if [ -n "${PERF_DEADLINE:-}" ] && [ $(( $(date +%s) - T0 )) -gt "$PERF_DEADLINE" ]; then
            say "perf $mode skipped: past PERF_DEADLINE=${PERF_DEADLINE}s"; continue
          fi
          timeout "${PERF_TIMEOUT:-300}" python3 benchmarks/gpu/perf_synthetic.py "$mode" "$W/perf.jsonl" \
            --conc "${PERF_CONC:-1,4,16,64}" --tp "${PERF_TP:-1}" --tag "$tag" --repeats "${PERF_BATCHES:-3}" \
            --pair "${PERF_PAIR:-dense}" --root "/root/perf-${PERF_PAIR:-dense}-$mode-$gpu" \
            --tau "$tau" --max-tokens "${PERF_MAX_TOKENS:-1024}" \
            --max-model-len "${PERF_MAX_MODEL_LEN:-4096}" --kv-cache-gib "${PERF_KV_GIB:-0}" ${PERF_EAGER:+--enforce-eager} \
            --gpu-util "${PERF_GPU_UTIL:-0.85}" ${PERF_TURN:+--turn "$PERF_TURN"} \
            ${PERF_CG_MODE:+--cudagraph-mode "$PERF_CG_MODE"} > "$log" 2>&1
          say "perf $mode tp${PERF_TP:-1} $tag tau$tau gpu$gpu rc=$?"
          grep RESULT "$log" | cut -c1-260
          grep -m1 -o "Maximum concurrency for .*" "$log" | sed "s/^/[$mode] /"
          grep -m1 -o "GPU KV cache size: .*" "$log" | sed "s/^/[$mode] /"
          grep -m1 -o "Available KV cache memory: .*" "$log" | sed "s/^/[$mode] /"
          grep -m1 -o "DFlash drafter KV in the target.*" "$log" | sed "s/^/[$mode] /"
          grep -m1 -o "DFlash step budget: [0-9]* tokens\|max_num_scheduled_tokens is set to [0-9]*" "$log" | sed "s/^/[$mode] /"
          grep -m3 -o "Traceback.*\|Error: .*\|error: .*" "$log" | sed "s/^/[$mode] /"
          grep -o "Estimated CUDA graph memory.*\|CUDA graph pool memory.*\|init engine .*" "$log" | sed "s/^/[$mode] /"
          grep -m6 -o "Graph capturing finished.*" "$log" | sed "s/^/[$mode] /"
          cp "$W/perf.jsonl" "$OUT/perf.jsonl" 2>/dev/null
        done
       done
      done ;;
    profile)
      timeout 300 python3 benchmarks/gpu/perf_synthetic.py plugin "$W/perf.jsonl" \
        --conc "${PROFILE_CONC:-1,16}" --tag profile --profile /root/step-profile.json \
        --root /root/p8b-profile > "$W/profile.log" 2>&1
      say "profile rc=$?"; grep RESULT "$W/profile.log" | cut -c1-600 ;;
    swa)
      for v in ${arg:-swa full}; do
        timeout 300 nice -n 10 python3 benchmarks/gpu/swa_context.py "$v" "$W/swa.jsonl" \
          --contexts "${SWA_CONTEXTS:-1024,8192,32768,65536,1024x4,32768x4}" --root "/root/q36-$v" \
          > "$W/swa-$v.log" 2>&1
        say "swa $v rc=$?"; grep RESULT "$W/swa-$v.log" | cut -c1-400
      done ;;
    trace)
      for m in ${arg:-base plugin}; do
        VLLM_DFLASH_DRAFT_LENGTH_SCHEDULE=${TRACE_SCHEDULE:-} timeout "${TRACE_TIMEOUT:-300}" python3 benchmarks/gpu/step_trace.py "$m" "$W/trace" --conc "${TRACE_CONC:-1}" \
          --pair "${TRACE_PAIR:-dense}" --kv-cache-gib "${TRACE_KV_GIB:-0}" \
          --max-tokens "${TRACE_MAX_TOKENS:-768}" --wait "${TRACE_WAIT:-0}" --gpu-util "${TRACE_GPU_UTIL:-0.85}" --steps "${TRACE_STEPS:-24}" --root "/root/trace-${TRACE_PAIR:-dense}-$m" > "$W/trace-$m.log" 2>&1
        say "trace $m rc=$?"; grep RESULT "$W/trace-$m.log" | cut -c1-1500
      done ;;
    drafter_gemm)  # drafter_gemm.py: one draft step's GEMMs, bf16 vs fp8 weights, 27B shapes
      timeout 300 python3 benchmarks/gpu/drafter_gemm.py "$W/drafter_gemm.jsonl" \
        --requests "${DRAFTER_GEMM_REQUESTS:-1,4,16}" > "$W/drafter_gemm.log" 2>&1
      say "drafter_gemm rc=$?"; grep RESULT "$W/drafter_gemm.log" | cut -c1-900
      cp "$W/drafter_gemm.jsonl" "$OUT/" 2>/dev/null ;;
    gdn)  # gdn_paths.py: GDN decode, speculative path vs packed path, 27B shapes
      timeout 300 python3 benchmarks/gpu/gdn_paths.py "$W/gdn.jsonl" --batches "${GDN_BATCHES:-64,128,256}" \
        --replays "${GDN_REPLAYS:-1:1,4:3}" ${GDN_NO_VLLM:+--no-vllm} > "$W/gdn.log" 2>&1
      say "gdn rc=$?"; grep RESULT "$W/gdn.log"; cp "$W/gdn.jsonl" "$OUT/" 2>/dev/null ;;
    sampling)  # sampling_check.py: distribution checks + the fp32 crash variants (+ hybrid)
      timeout "${SAMPLING_TIMEOUT:-540}" python3 benchmarks/gpu/sampling_check.py --out "$W/sampling" \
        --stages "${SAMPLING_STAGES:-crash,dense,pair}" --n "${SAMPLING_N:-1200}" \
        > "$W/sampling.log" 2>&1
      say "sampling rc=$?"; grep -A12 '^\[sampling_check\]' "$W/sampling.log" | cut -c1-600
      cp "$W/sampling/sampling_check.json" "$OUT/" 2>/dev/null ;;
    hybrid)  # hybrid_pair.py: one engine per stage, JSON lines in hybrid.jsonl
      # shellcheck disable=SC2086
      timeout "${HYBRID_TIMEOUT:-460}" python3 benchmarks/gpu/hybrid_pair.py "$W/hybrid.jsonl" \
        --stages "${HYBRID_STAGES:-dflash_fp8,nospec_fp8,dflash_bf16,dflash_fp8_stock}" \
        --deadline "${HYBRID_DEADLINE:-380}" --logs "$W/hybrid" ${HYBRID_ARGS:-} > "$W/hybrid.log" 2>&1
      say "hybrid rc=$?"; grep RESULT "$W/hybrid.log" | cut -c1-900 ;;
    serve)  # serve_check.py: vllm serve + OpenAI client, hybrid pair, no-spec vs DFlash
      # shellcheck disable=SC2086
      timeout "${SERVE_TIMEOUT:-480}" python3 benchmarks/gpu/serve_check.py --out "$W/serve${arg:+-$arg}" \
        --fixtures /root/fixtures-serve ${arg:+--dtype $arg} ${SERVE_ARGS:-} > "$W/serve${arg:+-$arg}.log" 2>&1
      say "serve ${arg} rc=$?"; grep '^\[serve_check\]' "$W/serve${arg:+-$arg}.log" | cut -c1-600
      cp "$W/serve${arg:+-$arg}/serve_check.json" "$OUT/serve_check${arg:+-$arg}.json" 2>/dev/null ;;
    prefix)  # prefix_caching_check.py: DFlash + prefix caching, tiny hybrid pair, fp32
      timeout "${PREFIX_TIMEOUT:-500}" python3 benchmarks/gpu/prefix_caching_check.py "$W/prefix" \
        > "$W/prefix.log" 2>&1
      say "prefix rc=$?"; grep '^\[prefix_caching_check\]' "$W/prefix.log" | cut -c1-1500
      (cd "$W/prefix" && tar -cJf "$OUT/prefix-runs.tar.xz" summary.json ./*.jsonl \
        ./*.json) 2>/dev/null ;;
    prefix_crash)  # prefix_crash.sh: the CUDA crash of DFlash + prefix caching, 4 variants
      W=$W OUT=$OUT bash benchmarks/gpu/prefix_crash.sh
      say "prefix_crash done" ;;
    chat)  # multiturn_chat.py: 27B-shaped pair, multi-turn chat, prefix caching x DFlash
      # CHAT_TAG: one log and result file per tag (several chat runs in one call, W_KEEP=1)
      local tag=${CHAT_TAG:+-$CHAT_TAG}
      timeout "${CHAT_TIMEOUT:-480}" python3 benchmarks/gpu/multiturn_chat.py "$OUT/chat$tag.jsonl" \
        ${CHAT_ARGS:-} > "$W/chat$tag.log" 2>&1
      say "chat$tag rc=$?"; cut -c1-700 "$OUT/chat$tag.jsonl" 2>/dev/null
      grep -E "Error|error:|illegal|Traceback|Profiling CUDA graph" "$W/chat$tag.log" | cut -c1-400 | tail -8 ;;
    serving)  # tests/e2e/test_serving_features.py on the GPU (float32; SERVING_K: pytest -k)
      # serving:dense / serving:hybrid: one pair (own files), e.g. both at once on one
      # GPU: "serving:dense@0" "serving:hybrid@0" with SERVING_SERVER_ARGS at 0.2
      # serving:PAIR/VARIANT: a diagnosis variant of the DFlash server (its own files):
      # sync (--no-async-scheduling), PATCH (VLLM_DFLASH_DISABLE=PATCH for both servers)
      local variant="" vargs="" venv="" blk=${CUDA_LAUNCH_BLOCKING:-0}
      [[ $arg == */* ]] && { variant=${arg#*/}; arg=${arg%%/*}; }
      case $variant in
        "") ;;
        sync) vargs=" --no-async-scheduling" ;;
        blocking) blk=1 ;;
        *) venv=$variant ;;
      esac
      local tag=${arg:+-$arg}${variant:+-$variant} k=${SERVING_K:-}
      [ -n "$variant" ] && k=${SERVING_VARIANT_K:-min_tokens}  # a variant: these tests only
      [ -n "$arg" ] && k="$arg${k:+ and ($k)}"
      python3 -c "import pytest" > "$W/serving-imports$tag.log" 2>&1 \
        || say "serving: $(tail -1 "$W/serving-imports$tag.log")"
      VLLM_DFLASH_TEST_SERVER_ARGS="${SERVING_SERVER_ARGS:---gpu-memory-utilization 0.3}$vargs" \
        VLLM_DFLASH_DISABLE=${venv:-${VLLM_DFLASH_DISABLE:-}} CUDA_LAUNCH_BLOCKING=$blk timeout "${SERVING_TIMEOUT:-560}" python3 -m pytest tests/e2e/test_serving_features.py \
        ${k:+-k "$k"} -p no:cacheprovider -q -rA -s --junitxml "$W/pytest-serving$tag.xml" \
        --basetemp "$W/serving-tmp$tag" > "$W/serving$tag.log" 2>&1
      say "serving$tag rc=$?"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$W/serving$tag.log" | cut -c1-600 | tail -40
      cp "$W/pytest-serving$tag.xml" "$OUT/" 2>/dev/null
      for f in "$W"/serving-tmp"$tag"/*/dflash.log "$W"/serving-tmp"$tag"/*/base.log; do
        [ -f "$f" ] && grep -E "Avg Draft acceptance|Mean acceptance|Accepted|ERROR|Traceback|grammar|FSM|internal error" "$f" \
          | cut -c1-400 | tail -8 | sed "s|^|$(basename "$(dirname "$f")")/$(basename "$f"): |"
      done ;;
    serving_probe)  # serving_probe.py: structured outputs / logprobs on several servers
      timeout "${PROBE_TIMEOUT:-240}" python3 benchmarks/gpu/serving_probe.py "$W/probe" \
        ${PROBE_VARIANTS:+--variants "$PROBE_VARIANTS"} \
        ${PROBE_SERVER_ARGS:+"--server-args=$PROBE_SERVER_ARGS"} > "$W/serving_probe.log" 2>&1
      say "serving_probe rc=$?"; grep '^\[serving_probe\]' "$W/serving_probe.log" | cut -c1-700
      cp "$W/probe/serving_probe.json" "$OUT/" 2>/dev/null ;;
    sampling_accept)  # tests/e2e/test_sampling_acceptance.py on the GPU; sampling_accept:DTYPE
      VLLM_DFLASH_TEST_SAMPLING_ARGS="--dtype ${arg:-float32} ${SAMPLING_ACCEPT_ARGS:-}" \
        timeout "${SAMPLING_TIMEOUT:-400}" python3 -m pytest tests/e2e/test_sampling_acceptance.py \
        -p no:cacheprovider -q -rA -s --basetemp "$W/sa-${arg:-float32}" > "$W/sampling_accept-${arg:-float32}.log" 2>&1
      say "sampling_accept ${arg:-float32} rc=$?"
      grep -E "^sampling with accepted|passed|failed|^FAILED|Error" "$W/sampling_accept-${arg:-float32}.log" | cut -c1-2500 | tail -8 ;;
    flashinfer)  # the carried FlashInfer GDN prefill module vs a float64 reference
      timeout 300 python3 benchmarks/gpu/flashinfer_selftest.py --json "$W/flashinfer_selftest.json" \
        > "$W/flashinfer_selftest.log" 2>&1
      say "flashinfer selftest rc=$?"; grep -E '^(PASS|FAIL|\[selftest\])' "$W/flashinfer_selftest.log" | cut -c1-300 ;;
    *) say "unknown stage $1" ;;
  esac
}
# STAGE@N runs in the background on GPU N (two stages on two GPUs at once), and
# STAGE+STAGE@N runs those in order there; plain stages run in the foreground.
for stage in "$@"; do
  if [[ $stage == *@* ]]; then
    ( export CUDA_VISIBLE_DEVICES=${stage##*@}
      IFS=+ read -ra seq <<< "${stage%@*}"
      for s in "${seq[@]}"; do run_stage "$s"; done ) &
  else
    run_stage "$stage"
  fi
done
wait
say "done"
