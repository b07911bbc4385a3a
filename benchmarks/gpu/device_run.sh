#!/usr/bin/env bash
# Entry point for a lent GPU machine (the `run` tool): unpack the carried vLLM
# 0.20.1 bundle, install this plugin next to it, run the given stages.
#   bash benchmarks/gpu/device_run.sh check|perf|all     (results under $OUT)
set -uo pipefail
# $OUT brings back at most 8 files: work in $W, return a summary + one log archive.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=/tmp/vllm-dflash-gpu; mkdir -p "$W"
T0=$(date +%s)
say() { echo "[device $(( $(date +%s) - T0 ))s] $*" | tee -a "$W/device.log"; }
finish() {
  cp "$W/device.log" "$OUT/" 2>/dev/null
  cp "$W/check/gpu_check.json" "$W/perf.jsonl" "$W/doctor.json" "$OUT/" 2>/dev/null
  tar -C "$W" -cJf "$OUT/logs.tar.xz" --exclude='*.trace.jsonl' . 2>/dev/null
}
trap finish EXIT
if [ ! -d /root/site/vllm ]; then
  cat .gpu-carry/vllm-site.tar.xz.* | xz -dc | tar -x -C /root || { say "unpack failed"; exit 1; }
  python3 -m compileall -q -j 16 /root/site >/dev/null 2>&1
  say "bundle unpacked"
fi
export PYTHONPATH=/root/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# The plugin's entry point must be discoverable: install its metadata into the site dir.
python3 -m pip install -q --no-deps --no-index --no-build-isolation --target /root/site . \
  >"$W/pip.log" 2>&1 || { say "plugin install failed"; cat "$W/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$W/device.log"
python3 -m vllm_dflash.cli doctor --json > "$W/doctor.json" 2>"$W/doctor.err"; say "doctor rc=$?"
for stage in "$@"; do
  case $stage in
    check) python3 benchmarks/gpu/gpu_check.py --out "$W/check" --budget "${BUDGET:-500}" --runs "${RUNS:-}" 2>&1 | tail -40 ;;
    perf)
      for mode in ${PERF_MODES:-base stock plugin}; do
        timeout 240 python3 benchmarks/gpu/perf_synthetic.py "$mode" "$W/perf.jsonl" \
          --conc "${PERF_CONC:-1,4,16,64}" > "$W/perf-$mode.log" 2>&1
        say "perf $mode rc=$?"; grep RESULT "$W/perf-$mode.log"
      done ;;
  esac
done
say "done"
