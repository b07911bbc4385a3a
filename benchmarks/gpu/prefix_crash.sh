#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The CUDA crash of DFlash + prefix caching on the tiny hybrid pair (docs/hybrid.md,
# "Open defect on CUDA"), four engines at once on one GPU (2 GiB KV each):
#   guarded     gpu_check.py run hybrid-swa-eager-fp32-long-prefixcache with the
#               input-id guard (input_ids_guard/: DEBUG_BAD_IDS + the last steps)
#   replay_off  the same workload, vLLM's 1 + k GDN layout (dflash_gdn_state_replay off)
#   sync        the same workload, synchronous scheduling
#   no_pc       the same workload, DFlash without prefix caching
# Called by device_run.sh (stage prefix_crash) with $W and $OUT set; PYTHONPATH as there.
set -uo pipefail
W=${W:?} OUT=${OUT:?}
GUARD=benchmarks/gpu/input_ids_guard
D=$W/prefix_crash; mkdir -p "$D"
PYTHONPATH=$GUARD:$PYTHONPATH timeout "${CRASH_TIMEOUT:-150}" python3 benchmarks/gpu/gpu_check.py \
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
  PYTHONPATH=$GUARD:$PWD:$PYTHONPATH VLLM_DFLASH_DISABLE=$disable timeout "${CRASH_TIMEOUT:-150}" \
    python3 benchmarks/gpu/run_llm.py --target "$F/target" --drafter "$F/drafter-hybrid" \
    --out "$D/$name.json" --dtype float32 --mm-limit 0 --gdn-prefill-backend torch --eager \
    --min-prompt-len 640 --max-num-batched-tokens 512 --kv-cache-gib 2 "$@" > "$D/$name.log" 2>&1
  echo "[prefix_crash] $name rc=$? $(grep -c DEBUG_BAD_IDS "$D/$name.log") bad-id stops"
}
sleep 5; variant replay_off dflash_gdn_state_replay --prefix-caching > "$D/replay_off.out" &
sleep 5; variant sync "" --prefix-caching --sync-scheduling > "$D/sync.out" &
sleep 5; variant no_pc "" --no-prefix-caching > "$D/no_pc.out" &
wait
grep '^\[gpu_check\]' "$D/guarded.log" | cut -c1-260
cat "$D"/*.out
grep -h "DEBUG_BAD_IDS\|DEBUG_STEP" "$W"/check/*.log "$D"/*.log 2>/dev/null | cut -c1-3000 | head -12
grep -h "DEBUG_BAD_IDS\|DEBUG_STEP" "$W"/check/*.log "$D"/*.log > "$OUT/prefix_crash-debug.txt" 2>/dev/null
(cd "$D" && tar -cJf "$OUT/prefix_crash.tar.xz" ./*.json ./*.out 2>/dev/null)
exit 0
