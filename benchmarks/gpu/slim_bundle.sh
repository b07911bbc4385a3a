#!/usr/bin/env bash
# Slim a vLLM 0.20.1 device bundle (vllm-site.tar.xz.00 from make-bundle.sh) so that
# it plus this checkout fits one 64 MiB `run` carry: drops sources and type stubs the
# device never reads (*.cu, *.cuh, *.cc, *.pyi, vLLM's C headers, test folders of
# dependencies, tvm_ffi's third-party sources) and vLLM's MoE kernels (`_moe_C`: no
# GPU run here loads an MoE model; vLLM's `import_kernels` suppresses its ImportError),
# and recompresses with xz -9e.
#   usage: benchmarks/gpu/slim_bundle.sh IN_DIR OUT_DIR   (IN_DIR holds vllm-site.tar.xz.*)
set -euo pipefail
IN=$(realpath "$1"); OUTD=$(realpath -m "$2"); mkdir -p "$OUTD"
T=$(mktemp -d /tmp/slim.XXXXXX); trap 'rm -rf "$T"' EXIT
cat "$IN"/vllm-site.tar.xz.* | xz -dc | tar -x -C "$T"
find "$T/site" \( -name '*.cu' -o -name '*.cuh' -o -name '*.cc' -o -name '*.pyi' \) -delete
find "$T/site/vllm" -name '*.h' -delete
rm -f "$T/site/vllm/_moe_C.abi3.so"
rm -rf "$T/site/tvm_ffi/3rdparty/libbacktrace" "$T/site/supervisor/tests" "$T/site/dill/tests"
rm -f "$OUTD"/vllm-site.tar.xz.*
tar -C "$T" -cf - site | xz -9e -T0 | split -b 60m -d - "$OUTD/vllm-site.tar.xz."
ls -l "$OUTD"/vllm-site.tar.xz.*
