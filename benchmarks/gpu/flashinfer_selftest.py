# SPDX-License-Identifier: Apache-2.0
"""Device self-test of the carried FlashInfer GDN prefill module (sm90, no nvcc).

    PYTHONPATH=/root/site python3 benchmarks/gpu/flashinfer_selftest.py [--json OUT] [--no-vllm]
    bash benchmarks/gpu/device_run.sh flashinfer      # the same, after unpacking the carry

Checks, in order (each line starts with PASS, FAIL or INFO; exit 0 when no FAIL):

1. flashinfer imports from the carry and ``gen_gdn_prefill_sm90_module()`` is AOT
   (its ``.so`` under ``flashinfer/data/aot``): loading it compiles nothing
   (``FLASHINFER_DISABLE_JIT=1`` unless ``--allow-jit``: a JIT attempt raises);
   load time, nvcc on PATH or not, which ``libcudart`` the process mapped.
2. ``flashinfer.gdn_prefill.chunk_gated_delta_rule`` on small tensors (head size
   128, 5 sequences of 1..200 tokens, so chunk boundaries of 64 are crossed; alpha,
   beta, initial state given: the calls vLLM makes) against a float64 per-token
   gated delta rule on the GPU (the recurrence of
   ``tests/helpers/reference.py:gated_delta_rule_f64``, state layout [N, HV, V, K]):
   GVA (2 qk / 4 v heads) and equal heads, bf16 and fp16. Error = max |x - ref| /
   max |ref| for the output and the final state; tolerance bf16 0.04, fp16 0.02.
3. A variant that was not prebuilt (no initial state, with ``VARIANTS=vllm``) must
   raise "not prebuilt" (a Python exception, no crash).
4. Unless ``--no-vllm``: vLLM's own wrappers on the same inputs
   (``gdn_linear_attn.fi_chunk_gated_delta_rule``, which the FlashInfer backend of
   ``ChunkGatedDeltaRule`` calls, and FLA's Triton ``chunk_gated_delta_rule``): both
   against the reference (same tolerance), FlashInfer vs Triton error reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

TOL = {"bfloat16": 0.04, "float16": 0.02}
SEQLENS = [1, 63, 64, 65, 200]
HEAD = 128


def reference(q, k, v, alpha, beta, h0, cu, scale):
    """float64 gated delta rule per token. q, k [T, H, D]; v [T, HV, D];
    alpha (decay factor, not log), beta [T, HV]; h0 [N, HV, V, K] or None.
    Returns o [T, HV, V] and the final states [N, HV, V, K]."""
    import torch

    dt = torch.float64
    hv = v.shape[1]
    rep = hv // q.shape[1]
    q, k = (x.to(dt).repeat_interleave(rep, dim=1) for x in (q, k))
    v, alpha, beta = v.to(dt), alpha.to(dt), beta.to(dt)
    n = cu.numel() - 1
    o = torch.zeros_like(v)
    states = []
    for s in range(n):
        a, b = int(cu[s]), int(cu[s + 1])
        st = (
            h0[s].to(dt).clone()
            if h0 is not None
            else torch.zeros(hv, v.shape[2], k.shape[2], dtype=dt, device=v.device)
        )
        for t in range(a, b):
            st = st * alpha[t][:, None, None]
            pred = (st @ k[t][:, :, None])[..., 0]  # [HV, V]
            delta = (v[t] - pred) * beta[t][:, None]
            st = st + delta[:, :, None] * k[t][:, None, :]
            o[t] = (st @ q[t][:, :, None])[..., 0] * scale
        states.append(st)
    return o, torch.stack(states)


def rel_err(x, ref) -> float:
    x, ref = x.double(), ref.double()
    if not bool(x.isfinite().all()):
        return math.inf
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-12))


def inputs(dtype_name: str, h_qk: int, h_v: int, seed: int = 0):
    import torch

    dtype = getattr(torch, dtype_name)
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    cu = torch.tensor([0] + list(_cumsum(SEQLENS)), dtype=torch.int64, device=dev)
    t = int(cu[-1])

    def rn(*shape):
        return torch.randn(*shape, generator=g, device=dev)

    q = torch.nn.functional.normalize(rn(t, h_qk, HEAD), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(rn(t, h_qk, HEAD), dim=-1).to(dtype)
    v = rn(t, h_v, HEAD).to(dtype)
    log_alpha = -torch.rand(t, h_v, generator=g, device=dev) * 0.7 - 0.01
    beta = torch.sigmoid(rn(t, h_v))
    h0 = rn(len(SEQLENS), h_v, HEAD, HEAD) * 0.1
    return q, k, v, log_alpha.float(), beta.float(), h0.float(), cu


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


class Report:
    def __init__(self):
        self.lines: list[dict] = []

    def add(self, status: str, name: str, **kw) -> None:
        self.lines.append({"status": status, "name": name, **kw})
        detail = " ".join(f"{k}={v}" for k, v in kw.items())
        print(f"{status} {name} {detail}", flush=True)

    @property
    def failed(self) -> bool:
        return any(x["status"] == "FAIL" for x in self.lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's wrappers")
    ap.add_argument(
        "--allow-jit", action="store_true", help="do not set FLASHINFER_DISABLE_JIT"
    )
    args = ap.parse_args()
    if not args.allow_jit:
        os.environ["FLASHINFER_DISABLE_JIT"] = "1"
    rep = Report()
    info: dict = {"nvcc": shutil.which("nvcc"), "python": sys.version.split()[0]}
    try:
        run(rep, info, args)
    except Exception as e:  # noqa: BLE001
        rep.add("FAIL", "selftest", error=f"{type(e).__name__}: {e}")
        traceback.print_exc()
    ok = not rep.failed
    print(f"[selftest] {'PASS' if ok else 'FAIL'}: "
          f"{sum(x['status'] == 'PASS' for x in rep.lines)} passed, "
          f"{sum(x['status'] == 'FAIL' for x in rep.lines)} failed; {json.dumps(info)}")  # fmt: skip
    if args.json:
        args.json.write_text(
            json.dumps({"ok": ok, "info": info, "results": rep.lines}, indent=1)
        )
    return 0 if ok else 1


def run(rep: Report, info: dict, args: argparse.Namespace) -> None:
    import torch

    info["torch"] = torch.__version__
    info["device"] = torch.cuda.get_device_name(0)
    info["capability"] = list(torch.cuda.get_device_capability(0))
    t0 = time.monotonic()
    import flashinfer
    from flashinfer.gdn_prefill import chunk_gated_delta_rule, get_gdn_prefill_module
    from flashinfer.jit.gdn import gen_gdn_prefill_sm90_module

    info["flashinfer"] = (
        f"{flashinfer.__version__} at {Path(flashinfer.__file__).parent}"
    )
    info["import_s"] = round(time.monotonic() - t0, 2)
    spec = gen_gdn_prefill_sm90_module()
    aot_dir = spec.aot_path.parent
    build_info = aot_dir.parent / "BUILD-INFO.txt"
    if build_info.exists():
        info["build_info"] = build_info.read_text().splitlines()[:2]
    variants_file = aot_dir / "VARIANTS.txt"
    variants = (
        set(variants_file.read_text().split()) if variants_file.exists() else None
    )
    rep.add("PASS" if spec.is_aot else "FAIL", "aot_module", path=str(spec.aot_path),
            exists=spec.is_aot)  # fmt: skip
    t0 = time.monotonic()
    get_gdn_prefill_module()
    load_s = round(time.monotonic() - t0, 2)
    maps = Path("/proc/self/maps").read_text().splitlines()
    cudart = sorted({ln.split()[-1] for ln in maps if "libcudart" in ln})
    mod = sorted({ln.split()[-1] for ln in maps if "gdn_prefill_sm90" in ln})
    rep.add("PASS" if mod and spec.is_aot else "FAIL", "module_loaded", load_s=load_s,
            so=mod, libcudart=cudart, nvcc_on_path=info["nvcc"])  # fmt: skip

    cases = [("gva", 2, 4), ("equal_heads", 4, 4)]
    ref_cache = {}
    for dtype_name in ("bfloat16", "float16"):
        for cname, h_qk, h_v in cases:
            q, k, v, log_a, beta, h0, cu = inputs(dtype_name, h_qk, h_v)
            scale = HEAD**-0.5
            o_ref, s_ref = reference(q, k, v, log_a.exp(), beta, h0, cu, scale)
            ref_cache[(dtype_name, cname)] = (
                q,
                k,
                v,
                log_a,
                beta,
                h0,
                cu,
                o_ref,
                s_ref,
            )
            sfx = f"{'bf16' if dtype_name == 'bfloat16' else 'half'}_g{int(h_v > h_qk)}b1a1i1c0"
            name = f"flashinfer_{dtype_name}_{cname}"
            if variants is not None and sfx not in variants:
                rep.add("INFO", name, skipped=f"variant {sfx} not prebuilt")
                continue
            t0 = time.monotonic()
            o, s = chunk_gated_delta_rule(
                q, k, v, g=log_a.exp(), beta=beta, scale=scale, initial_state=h0,
                output_final_state=True, cu_seqlens=cu,
            )  # fmt: skip
            torch.cuda.synchronize()
            eo, es = rel_err(o, o_ref), rel_err(s, s_ref)
            tol = TOL[dtype_name]
            rep.add("PASS" if eo <= tol and es <= tol else "FAIL", name,
                    variant=sfx, out_err=f"{eo:.2e}", state_err=f"{es:.2e}", tol=tol,
                    max_abs_out=f"{float((o.double() - o_ref).abs().max()):.3e}",
                    call_s=round(time.monotonic() - t0, 3))  # fmt: skip

    # a variant vLLM never calls (no initial state): compiled (VARIANTS=all) or a stub
    q, k, v, log_a, beta, h0, cu, *_ = ref_cache[("bfloat16", "gva")]
    try:
        o = chunk_gated_delta_rule(q, k, v, g=log_a.exp(), beta=beta, cu_seqlens=cu)
        torch.cuda.synchronize()
        o_ref, _ = reference(q, k, v, log_a.exp(), beta, None, cu, HEAD**-0.5)
        e = rel_err(o, o_ref)
        rep.add("PASS" if e <= TOL["bfloat16"] else "FAIL", "no_initial_state_variant",
                out_err=f"{e:.2e}", prebuilt=True)  # fmt: skip
    except Exception as ex:  # noqa: BLE001
        stub = "not prebuilt" in str(ex)
        expected = variants is not None and "bf16_g1b1a1i0c0" not in variants
        rep.add("PASS" if stub and expected else "FAIL", "no_initial_state_variant",
                raised=f"{type(ex).__name__}: {str(ex)[:160]}")  # fmt: skip

    if args.no_vllm:
        return
    try:
        from vllm.model_executor.layers.fla.ops import (
            chunk_gated_delta_rule as fla_chunk,
        )
        from vllm.model_executor.layers.mamba.gdn_linear_attn import (
            fi_chunk_gated_delta_rule,
        )
    except Exception as ex:  # noqa: BLE001
        rep.add(
            "INFO", "vllm_wrappers", skipped=f"vLLM import: {type(ex).__name__}: {ex}"
        )
        return
    for (dtype_name, cname), (
        q,
        k,
        v,
        log_a,
        beta,
        h0,
        cu,
        o_ref,
        s_ref,
    ) in ref_cache.items():
        sfx = f"{'bf16' if dtype_name == 'bfloat16' else 'half'}_g{int(v.shape[1] > q.shape[1])}b1a1i1c0"
        # vLLM's layout: [1, T, H, D], g in log space, cu_seqlens int32
        args4 = [x.unsqueeze(0) for x in (q, k, v, log_a, beta)]
        cu32 = cu.to(torch.int32)
        errs = {}
        for which, fn in (
            ("flashinfer", fi_chunk_gated_delta_rule),
            ("triton", fla_chunk),
        ):
            if which == "flashinfer" and variants is not None and sfx not in variants:
                continue
            try:
                o, s = fn(*args4, initial_state=h0.clone(), output_final_state=True,
                          cu_seqlens=cu32, use_qk_l2norm_in_kernel=False)  # fmt: skip
                torch.cuda.synchronize()
                errs[which] = (rel_err(o[0], o_ref), rel_err(s, s_ref))
            except Exception as ex:  # noqa: BLE001
                errs[which] = (math.inf, math.inf)
                rep.add("FAIL", f"vllm_{which}_{dtype_name}_{cname}",
                        error=f"{type(ex).__name__}: {str(ex)[:200]}")  # fmt: skip
        tol = TOL[dtype_name]
        for which, (eo, es) in errs.items():
            if math.isfinite(eo):
                rep.add("PASS" if eo <= tol and es <= tol else "FAIL",
                        f"vllm_{which}_{dtype_name}_{cname}", out_err=f"{eo:.2e}",
                        state_err=f"{es:.2e}", tol=tol)  # fmt: skip
        if len(errs) == 2:
            rep.add("INFO", f"flashinfer_vs_triton_{dtype_name}_{cname}",
                    out_err_ratio=round(errs["flashinfer"][0] / max(errs["triton"][0], 1e-12), 2))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
