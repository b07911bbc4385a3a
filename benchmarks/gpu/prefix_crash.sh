#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# DFlash on FLEX_ATTENTION past torch.compile's recompile limit (docs/hybrid.md,
# "FLEX_ATTENTION's compile cache"): the tiny hybrid pair in float32, prompts of
# 640-729 tokens, four engines at once on one GPU (2 GiB KV each), all with
# TORCH_LOGS=recompiles (each engine's log counts its flex_attention variants):
#   guarded     gpu_check.py run hybrid-swa-eager-fp32-long-prefixcache (lossless vs
#               no-spec, drafts vs the reference) with the input-id guard
#               (input_ids_guard/: DEBUG_BAD_IDS + the last steps)
#   sync        the same workload, synchronous scheduling
#   no_pc       the same workload, DFlash without prefix caching
#   limit_off   dflash_flex_recompile_limit off, synchronous scheduling: expected to
#               fail with FailOnRecompileLimitHit (the patch's red check)
# Called by device_run.sh (stage prefix_crash) with $W and $OUT set; PYTHONPATH as there.
set -uo pipefail
W=${W:?} OUT=${OUT:?}
GUARD=benchmarks/gpu/input_ids_guard
D=$W/prefix_crash; mkdir -p "$D"
PYTHONPATH=$GUARD:$PYTHONPATH TORCH_LOGS=recompiles timeout "${CRASH_TIMEOUT:-150}" python3 benchmarks/gpu/gpu_check.py \
  --out "$W/check" --budget $(( ${CRASH_TIMEOUT:-150} - 20 )) \
  --runs hybrid-swa-eager-fp32-long-prefixcache --jobs 1 --slots-per-gpu 4 > "$D/guarded.log" 2>&1 &
F=""
for _ in $(seq 90); do
  F=$(ls -d /root/vllm-dflash-fixtures/gpu-hybrid-*/drafter-hybrid 2>/dev/null | head -1) && [ -n "$F" ] && break
  sleep 2
done
[ -n "$F" ] || { echo "[prefix_crash] no GPU hybrid fixture"; wait; exit 1; }
F=$(dirname "$F")
variant() {  # NAME DISABLE RUN_LLM_ARGS...
  local name=$1 disable=$2; shift 2
  PYTHONPATH=$GUARD:$PWD:$PYTHONPATH VLLM_DFLASH_DISABLE=$disable TORCH_LOGS=recompiles timeout "${CRASH_TIMEOUT:-150}" \
    python3 benchmarks/gpu/run_llm.py --target "$F/target" --drafter "$F/drafter-hybrid" \
    --out "$D/$name.json" --dtype float32 --mm-limit 0 --gdn-prefill-backend torch --eager \
    --min-prompt-len 640 --max-num-batched-tokens 512 --kv-cache-gib 2 "$@" > "$D/$name.log" 2>&1
  echo "[prefix_crash] $name rc=$? $(grep -c DEBUG_BAD_IDS "$D/$name.log") bad-id stops," \
    "$(grep -c 'Recompiling function flex_attention' "$D/$name.log") flex_attention recompiles," \
    "$(grep -c FailOnRecompileLimitHit "$D/$name.log") recompile-limit failures"
}
sleep 5; variant sync "" --prefix-caching --sync-scheduling > "$D/sync.out" &
sleep 5; variant limit_off dflash_flex_recompile_limit --prefix-caching --sync-scheduling > "$D/limit_off.out" &
sleep 5; variant no_pc "" --no-prefix-caching > "$D/no_pc.out" &
wait
grep '^\[gpu_check\]' "$D/guarded.log" | cut -c1-260
echo "[prefix_crash] guarded: $(grep -c 'Recompiling function flex_attention' "$W"/check/*.log) flex_attention recompiles"
grep -h "Recompiling function flex_attention" -A3 "$D/limit_off.log" | grep -o "triggered by.*\|guard failure.*\|  - .*" | cut -c1-200 | sort | uniq -c | sort -rn | head -20
cat "$D"/*.out
grep -h "DEBUG_BAD_IDS\|DEBUG_STEP" "$W"/check/*.log "$D"/*.log 2>/dev/null | cut -c1-3000 | head -12
grep -h "DEBUG_BAD_IDS\|DEBUG_STEP" "$W"/check/*.log "$D"/*.log > "$OUT/prefix_crash-debug.txt" 2>/dev/null
(cd "$D" && tar -cJf "$OUT/prefix_crash.tar.xz" ./*.json ./*.out 2>/dev/null)
exit 0
