#!/usr/bin/env bash
# Prebuild FlashInfer's GDN prefill module (sm_90a) on a CPU machine that has a
# CUDA toolkit, and pack a small carry for the lent H200, which has no nvcc.
#
#   PY=/work/main/.venv/bin/python benchmarks/gpu/flashinfer_carry.sh
#
# Output: .gpu-carry/flashinfer-gdn.tar.xz, a site-dir overlay holding
#   flashinfer/                       flashinfer-python 0.6.8.post1 (the version
#                                     `pip install vllm==0.20.1` brings), minus the
#                                     C++ sources/headers only a JIT build reads,
#   flashinfer/data/aot/gdn_prefill_sm90/gdn_prefill_sm90.so   the prebuilt module,
#   flashinfer/data/aot/BUILD-INFO.txt  versions, variants, flags, sha256,
#   flashinfer_python-0.6.8.post1.dist-info/
# device_run.sh unpacks it into /root/site (next to the vLLM bundle, which
# already holds apache-tvm-ffi 0.1.9).
#
# How the device loads it without nvcc/ninja: JitSpec.build_and_load()
# (flashinfer/jit/core.py) first checks `is_aot`, i.e. whether
# FLASHINFER_AOT_DIR/<name>/<name>.so exists, and if so only calls
# tvm_ffi.load_module() on it. FLASHINFER_AOT_DIR is <package>/data/aot unless
# the flashinfer-jit-cache package is installed (it is not). No cache dir,
# ninja file or up-to-date check is involved. gen_gdn_prefill_sm90_module()
# still renders its .cu sources into ~/.cache/flashinfer/... before that check,
# so the 3 GDN files in data/csrc are kept.
#
# The build is flashinfer's own (gen_gdn_prefill_sm90_module().build(): its
# flags and ninja file, FLASHINFER_CUDA_ARCH_LIST=9.0a since there is no GPU).
# The module has 64 kernel instantiations (fp16/bf16 x GVA x beta x alpha x
# initial state x checkpointing), each a CUTLASS sm90 compile of several
# minutes (about 3 hours for all of them with 2 jobs on a shared 2-core
# machine). VARIANTS picks which are compiled:
#   vllm (default)  the 4 that vLLM 0.20.1 can call (fi_chunk_gated_delta_rule in
#                   model_executor/layers/mamba/gdn_linear_attn.py always passes
#                   g, beta and initial_state, never checkpoints): {fp16, bf16} x
#                   GVA {0, 1}, beta, alpha, initial state, no checkpointing;
#   all             all 64 (flashinfer's module unchanged);
#   a,b,...         explicit suffixes, e.g. bf16_g1b1a1i1c0.
# Every variant left out is replaced by a stub that throws
# "... was not prebuilt ..." (a Python RuntimeError through tvm-ffi), not a crash.
#
# env: PY          python with torch (flashinfer.jit imports it; the build only
#                  reads torch's _GLIBCXX_USE_CXX11_ABI and version)
#      CUDA_HOME   default /usr/local/cuda-13.0 (nvcc 13.0.88 here; the device's
#                  torch is cu130)
#      FI_WHEEL    flashinfer_python-0.6.8.post1 wheel (default: pip download)
#      WORK        build dir, kept for incremental rebuilds (default /tmp/flashinfer-carry)
#      MAX_JOBS    parallel nvcc jobs (default 2)
#      VARIANTS    vllm | all | suffix list (above)
#      OUT_TAR     default <repo>/.gpu-carry/flashinfer-gdn.tar.xz
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-python3}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda-13.0}
WORK=$(realpath -m "${WORK:-/tmp/flashinfer-carry}")
OUT_TAR=$(realpath -m "${OUT_TAR:-$REPO/.gpu-carry/flashinfer-gdn.tar.xz}")
export VARIANTS=${VARIANTS:-vllm}
FI_VERSION=0.6.8.post1
TVM_FFI_VERSION=0.1.9   # what the vLLM bundle carries (bundle-manifest.txt)
export MAX_JOBS=${MAX_JOBS:-2}
log() { echo "[flashinfer-carry $(date +%T)] $*" >&2; }

[ -x "$CUDA_HOME/bin/nvcc" ] || { log "no nvcc under CUDA_HOME=$CUDA_HOME"; exit 1; }
command -v ninja >/dev/null || [ -x "$(dirname "$PY")/ninja" ] \
  || { log "ninja not found (pip install ninja)"; exit 1; }
"$PY" -c 'import torch' || { log "PY=$PY has no torch"; exit 1; }
mkdir -p "$WORK/wheels"

# 1. flashinfer-python + the device's tvm-ffi (headers and libinfo) into $WORK/site
if [ -z "${FI_WHEEL:-}" ]; then
  FI_WHEEL=$(ls "$WORK"/wheels/flashinfer_python-$FI_VERSION-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$FI_WHEEL" ]; then
    log "downloading flashinfer-python==$FI_VERSION"
    "$PY" -m pip download -q --no-deps -d "$WORK/wheels" "flashinfer-python==$FI_VERSION"
    FI_WHEEL=$(ls "$WORK"/wheels/flashinfer_python-$FI_VERSION-*.whl | head -1)
  fi
fi
if ! ls "$WORK"/wheels/apache_tvm_ffi-$TVM_FFI_VERSION-*.whl >/dev/null 2>&1; then
  log "downloading apache-tvm-ffi==$TVM_FFI_VERSION (for the build python)"
  "$PY" -m pip download -q --no-deps -d "$WORK/wheels" "apache-tvm-ffi==$TVM_FFI_VERSION"
fi
if [ ! -f "$WORK/site/.stamp-$FI_VERSION" ]; then
  rm -rf "$WORK/site"
  "$PY" -m pip install -q --no-deps --no-compile --target "$WORK/site" \
    "$FI_WHEEL" "$WORK"/wheels/apache_tvm_ffi-$TVM_FFI_VERSION-*.whl
  touch "$WORK/site/.stamp-$FI_VERSION"
fi
# flashinfer's import needs pynvml (nvidia-ml-py; the device image has it)
if ! PYTHONPATH="$WORK/hostdeps" "$PY" -c 'import pynvml' 2>/dev/null; then
  "$PY" -m pip install -q --no-deps --target "$WORK/hostdeps" nvidia-ml-py
fi
# flashinfer links with -lcuda (-L$CUDA_HOME/lib64/stubs). A toolkit without the
# driver stub (this one) gets an empty libcuda.so with the driver's soname: the
# module reaches the driver through cudaGetDriverEntryPointByVersion, and on the
# device NEEDED libcuda.so.1 is the real driver.
EXTRA_LD=""
if [ ! -e "$CUDA_HOME/lib64/stubs/libcuda.so" ] && ! ldconfig -p | grep -q 'libcuda\.so '; then
  mkdir -p "$WORK/stubs"
  echo 'void flashinfer_carry_libcuda_stub(void) {}' \
    | cc -shared -fPIC -x c - -Wl,-soname,libcuda.so.1 -o "$WORK/stubs/libcuda.so"
  EXTRA_LD="-L$WORK/stubs"
fi

# 2. build with flashinfer's own JIT machinery, arch pinned to 9.0a (no GPU here)
log "building gdn_prefill_sm90 (VARIANTS=$VARIANTS, MAX_JOBS=$MAX_JOBS)"
T0=$(date +%s)
SO=$(cd "$WORK" && PATH="$CUDA_HOME/bin:$(dirname "$PY"):$PATH" PYTHONPATH="$WORK/site:$WORK/hostdeps" \
  CUDA_HOME="$CUDA_HOME" FLASHINFER_CUDA_ARCH_LIST="9.0a" FLASHINFER_WORKSPACE_BASE="$WORK/ws" \
  FLASHINFER_EXTRA_LDFLAGS="$EXTRA_LD" FLASHINFER_JIT_VERBOSE="${FLASHINFER_JIT_VERBOSE:-0}" \
  "$PY" - <<'EOF'
import itertools, os, tvm_ffi, flashinfer
from flashinfer.jit.utils import write_if_different
assert tvm_ffi.__version__ == "0.1.9", tvm_ffi.__version__
import flashinfer.jit.gdn as jit_gdn
ALL = [f"{d}_g{g}b{b}a{a}i{i}c{c}" for d in ("half", "bf16")
       for g, b, a, i, c in itertools.product((0, 1), repeat=5)]
want = os.environ["VARIANTS"]
keep = (set(ALL) if want == "all"
        else {f"{d}_g{g}b1a1i1c0" for d in ("half", "bf16") for g in (0, 1)} if want == "vllm"
        else set(want.split(",")))
assert keep <= set(ALL), f"unknown variants {sorted(keep - set(ALL))}"
STUB = """// flashinfer_carry.sh: variant {sfx} not prebuilt (VARIANTS={want})
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <stdexcept>
#include "cutlass/arch/arch.h"
namespace flat {{
template <bool IsGVA, bool NeedsBeta, bool NeedsAlpha, bool InitStateFromInput,
          bool EnableCheckpointing, typename ArchTag, typename TO, typename TQKV, typename TState>
void launch_delta_rule_prefill_kernel_gbai(
    cudaStream_t stream, TO* output, TState* output_state, TQKV const* q, TQKV const* k,
    TQKV const* v, TState const* input_state, float const* alpha, float const* beta,
    int64_t const* cu_seqlens, uint8_t* workspace_buffer, int32_t num_seqs, int32_t num_q_heads,
    int32_t num_k_heads, int32_t num_v_heads, int32_t num_o_heads, int32_t head_size,
    int64_t total_seqlen, float scale, int32_t sm_count, float* state_checkpoints,
    int64_t const* checkpoint_cu_starts, int32_t checkpoint_every_n_tokens);
template <>
void launch_delta_rule_prefill_kernel_gbai<{g}, {b}, {a}, {i}, {c}, cutlass::arch::Sm90, {t}, {t}, float>(
    cudaStream_t, {t}*, float*, {t} const*, {t} const*, {t} const*, float const*, float const*,
    float const*, int64_t const*, uint8_t*, int32_t, int32_t, int32_t, int32_t, int32_t, int32_t,
    int64_t, float, int32_t, float*, int64_t const*, int32_t) {{
  throw std::runtime_error(
      "flashinfer gdn_prefill_sm90: variant {sfx} (dtype, GVA, beta, alpha, initial state, "
      "checkpointing) was not prebuilt: benchmarks/gpu/flashinfer_carry.sh VARIANTS={want}; "
      "rebuild with VARIANTS=all");
}}
}}  // namespace flat
"""
tf = lambda x: "true" if x == "1" else "false"


def render(path, content):  # gen_gdn_prefill_sm90_module's writer: stubs for left-out variants
    sfx = path.stem[len("gdn_prefill_kernel_"):]
    if path.name.startswith("gdn_prefill_kernel_") and sfx not in keep:
        d, r = sfx.split("_")
        content = STUB.format(sfx=sfx, want=want, t="half" if d == "half" else "nv_bfloat16",
                              g=tf(r[1]), b=tf(r[3]), a=tf(r[5]), i=tf(r[7]), c=tf(r[9]))
    write_if_different(path, content)  # unchanged files keep their mtime: no rebuild


jit_gdn.write_if_different = render
spec = jit_gdn.gen_gdn_prefill_sm90_module()
assert not spec.is_aot, "build site already holds an AOT module"
spec.write_ninja()  # always: build() keeps an existing ninja file (e.g. other ldflags)
spec.build(verbose=os.environ.get("FLASHINFER_JIT_VERBOSE") == "1")
with open(spec.build_dir / "VARIANTS.txt", "w") as fh:
    fh.write(" ".join(v for v in ALL if v in keep) + "\n")
print(spec.jit_library_path)
EOF
)
SO=$(echo "$SO" | tail -1)
BUILD_S=$(( $(date +%s) - T0 ))
log "built $SO in ${BUILD_S}s"

# 3. checks: no flat:: symbol left undefined (every variant is compiled or stubbed),
#    no link to libpython/libtorch, what the fatbin holds
if nm -D --undefined-only "$SO" | c++filt | grep -q 'flat::'; then
  log "undefined flat:: symbols:"; nm -D --undefined-only "$SO" | c++filt | grep 'flat::' >&2; exit 1
fi
if readelf -dW "$SO" | grep NEEDED | grep -Eqi 'python|torch|c10'; then
  log "module links libpython/libtorch"; readelf -dW "$SO" | grep NEEDED >&2; exit 1
fi
FATBIN=$("$PY" - "$SO" <<'EOF'
import struct, subprocess, sys
path = sys.argv[1]; data = open(path, "rb").read()
out = subprocess.run(["readelf", "-SW", path], capture_output=True, text=True, check=True).stdout
count = {}
for line in out.splitlines():
    if ".nv_fatbin" in line and "PROGBITS" in line:
        f = line.split("]", 1)[1].split(); off, size = int(f[3], 16), int(f[4], 16)
        p = off
        while p + 16 <= off + size:
            magic, _, hsz, fsz = struct.unpack_from("<IHHQ", data, p)
            if magic != 0xBA55ED50:
                p += 8; continue
            q = p + hsz
            while q < p + hsz + fsz:
                kind, _, ehsz, psz = struct.unpack_from("<HHIQ", data, q)
                arch, = struct.unpack_from("<I", data, q + 28)
                key = f"{'ptx' if kind == 1 else 'cubin'} sm_{arch}"
                count[key] = count.get(key, 0) + 1; q += ehsz + psz
            p = q
print(", ".join(f"{v} x {k}" for k, v in sorted(count.items())))
EOF
)

# 4. stage the site overlay
ST="$WORK/stage"; rm -rf "$ST"; mkdir -p "$ST"
cp -a "$WORK/site/flashinfer" "$WORK/site/flashinfer_python-$FI_VERSION.dist-info" "$ST/"
D="$ST/flashinfer/data"
# JIT-only inputs: cutlass/spdlog/include headers, all other C++ sources, build helpers
rm -rf "$D/cutlass" "$D/spdlog" "$D/include" "$D/build_backend.py" "$D/build_utils.py"
find "$D/csrc" -mindepth 1 -maxdepth 1 \
  -not -name gdn_prefill_sm90_kernel_inst.jinja -not -name gdn_prefill_launcher.cu \
  -not -name prefill_kernel_delta_rule_sm90.cu -exec rm -rf {} +
find "$ST" -name __pycache__ -prune -exec rm -rf {} +
A="$D/aot/gdn_prefill_sm90"; mkdir -p "$A"
cp "$SO" "$A/gdn_prefill_sm90.so"
strip --strip-debug "$A/gdn_prefill_sm90.so"
cp "$(dirname "$SO")/VARIANTS.txt" "$A/VARIANTS.txt"
{
  echo "flashinfer-python $FI_VERSION gdn_prefill_sm90 (flashinfer/jit/gdn.py) prebuilt for sm_90a; VARIANTS=$VARIANTS"
  echo "compiled variants (others throw 'not prebuilt'): $(cat "$A/VARIANTS.txt")"
  echo "built $(date -u +%FT%TZ) (build step ${BUILD_S}s, incremental: ninja redoes only what changed; MAX_JOBS=$MAX_JOBS); $("$CUDA_HOME/bin/nvcc" --version | tail -1)"
  echo "host compiler: $(c++ --version | head -1)"
  echo "tvm-ffi headers: apache-tvm-ffi $TVM_FFI_VERSION; torch (ABI flag source): $("$PY" -c 'import torch; print(torch.__version__, "cxx11abi", int(torch._C._GLIBCXX_USE_CXX11_ABI))')"
  echo "FLASHINFER_CUDA_ARCH_LIST=9.0a; libcuda: ${EXTRA_LD:+empty link stub (soname libcuda.so.1), }toolkit libcudart.so.13 (dynamic)"
  echo "sha256 $(sha256sum "$A/gdn_prefill_sm90.so" | cut -d' ' -f1)  gdn_prefill_sm90.so (strip --strip-debug)"
  echo "NEEDED: $(readelf -dW "$A/gdn_prefill_sm90.so" | awk '/NEEDED/{gsub(/[][]/, "", $5); printf "%s ", $5}')"
  echo "RUNPATH/RPATH: $(readelf -dW "$A/gdn_prefill_sm90.so" | grep -E 'RPATH|RUNPATH' | awk '{print $NF}' | tr '\n' ' ')"
  echo "fatbin: $FATBIN"
} > "$D/aot/BUILD-INFO.txt"
cat "$D/aot/BUILD-INFO.txt" >&2

# 5. pack (deterministic order/owner), report sizes
mkdir -p "$(dirname "$OUT_TAR")"
(cd "$ST" && tar --sort=name --owner=0 --group=0 --numeric-owner -cf - flashinfer \
   "flashinfer_python-$FI_VERSION.dist-info") | xz -9e -T1 > "$OUT_TAR.tmp"
mv "$OUT_TAR.tmp" "$OUT_TAR"
log "staged $(du -sb "$ST" | cut -f1) bytes; .so $(stat -c %s "$A/gdn_prefill_sm90.so") bytes"
log "wrote $OUT_TAR: $(stat -c %s "$OUT_TAR") bytes"
