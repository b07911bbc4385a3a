# SPDX-License-Identifier: Apache-2.0
"""benchmarks/gpu/step_trace.py: per-step GPU accounting of a profiler trace."""

import importlib.util
import json
import pathlib

import pytest

_PATH = pathlib.Path(__file__).parents[2] / "benchmarks" / "gpu" / "step_trace.py"
_spec = importlib.util.spec_from_file_location("step_trace", _PATH)
step_trace = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step_trace)


def _trace(draft_graph: bool) -> list[dict]:
    """Two steps of 1000 us; forward 600 us, then a 50 us host gap, draft 300 us."""
    ev, corr = [], 0

    def phase(name, ts, dur):
        ev.append({"ph": "X", "cat": "user_annotation", "name": f"gpu_model_runner: {name}",
                   "ts": ts, "dur": dur, "tid": 1})  # fmt: skip

    def kernel(name, launch_ts, ts, dur, api="cudaLaunchKernel"):
        nonlocal corr
        corr += 1
        cat = "cuda_driver" if api.startswith("cuLaunch") else "cuda_runtime"
        ev.append({"ph": "X", "cat": cat, "name": api, "ts": launch_ts,
                   "dur": 2, "tid": 1, "args": {"correlation": corr}})  # fmt: skip
        ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                   "tid": 7, "args": {"correlation": corr}})  # fmt: skip

    for step in range(3):
        base = step * 1000
        phase("forward", base, 100)
        kernel("nvjet_gemm", base + 10, base + 20, 600, "cudaGraphLaunch")
        phase("draft", base + 120, 500)
        api = "cudaGraphLaunch" if draft_graph else "cudaLaunchKernel"
        kernel("flash_fwd_kernel", base + 130, base + 670, 100, api)
        # cuBLASLt launches its eager GEMMs through the driver API
        kernel("nvjet_gemm_small", base + 140, base + 770, 200,
               api if draft_graph else "cuLaunchKernelEx")  # fmt: skip
    return ev


def test_steps_idle_phases_and_graph_share():
    res = step_trace.analyse(_trace(draft_graph=False))
    assert res["steps"] == 2  # the third step has no successor to close it
    med = res["median"]
    assert med["step_ms"] == pytest.approx(1.0)
    assert med["busy_ms"] == pytest.approx(0.9)
    assert med["idle_ms"] == pytest.approx(0.1)
    assert med["phase_ms"] == {
        "draft": pytest.approx(0.3),
        "forward": pytest.approx(0.6),
    }
    assert med["draft_kinds_ms"] == {"attention": 0.1, "gemm": 0.2}
    assert med["draft_graph_ms"] == 0.0
    assert med["gaps"]["forward->draft"] == pytest.approx(0.05)
    assert med["gaps"]["draft->next step"] == pytest.approx(0.05)
    assert step_trace.analyse(_trace(draft_graph=True))["median"]["draft_graph_ms"] == (
        pytest.approx(0.3)
    )


def test_kernel_kinds():
    assert step_trace.kernel_kind("void flash::flash_fwd_kernel<...>") == "attention"
    assert step_trace.kernel_kind("nvjet_tst_64x8_64x16") == "gemm"
    assert step_trace.kernel_kind("triton_poi_fused_add_0") == "triton"
    assert step_trace.kernel_kind("Memcpy DtoD (Device -> Device)") == "copy"


def test_request_split():
    """TTFT, decode time per generated token and tokens a verify step produced."""
    from types import SimpleNamespace as NS

    def out(first, last, ttft, n):
        m = NS(first_token_ts=first, last_token_ts=last, first_token_latency=ttft)
        return NS(metrics=m, outputs=[NS(token_ids=list(range(n)))])

    outs = [out(10.0, 12.0, 0.1, 101), out(10.0, 13.0, 0.3, 101), NS(metrics=None)]
    before = {
        "vllm:spec_decode_num_drafts": 5,
        "vllm:spec_decode_num_accepted_tokens": 9,
    }
    after = {
        "vllm:spec_decode_num_drafts": 45,
        "vllm:spec_decode_num_accepted_tokens": 209,
    }
    split = step_trace.request_split(outs, before, after)
    assert split == {
        "ttft_s": 0.2,
        "decode_s": 2.5,
        "decode_ms_per_token": 25.0,
        "draft_steps": 40,
        "tokens_per_step": 6.0,
    }
    assert step_trace.request_split([], {}, {}) == {}  # no speculation, no metrics


def test_untraced_steps_and_time_outside_them(tmp_path):
    """The untraced batch's wall time splits into its engine steps (from a
    VLLM_DFLASH_STEP_LOG file, only the lines inside the batch's window) and the
    rest, which no step covers."""
    _ps_path = _PATH.parent / "perf_synthetic.py"
    spec = importlib.util.spec_from_file_location("perf_synthetic", _ps_path)
    ps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ps)

    def line(t, ms, decode, dmax=15):
        return json.dumps({"t": t, "ms": ms, "reqs": 1, "tokens": 1 + dmax if decode else 512,
                           "drafts": dmax if decode else 0, "dmax": dmax if decode else 0,
                           "new": 0 if decode else 1, "decode": decode})  # fmt: skip

    log = tmp_path / "steps.jsonl"
    log.write_text("\n".join([
        line(99.0, 20.0, True),  # the warm-up batch: outside the window
        line(100.1, 90.0, False),  # prefill
        *[line(100.1 + 0.025 * i, 24.0, True) for i in range(1, 41)],
        line(102.0, 30.0, True),
    ]) + "\n")  # fmt: skip
    steps = ps.step_summary(str(log), 100.0, 102.2)
    assert steps["mixed"] == {"steps": 1, "ms": 90.0}
    assert steps["decode"]["15"]["steps"] == 41
    assert steps["decode"]["15"]["median_ms"] == 24.0
    assert steps["slowest"][0] == [90.0, "mixed", 1]
    # 2.2 s of wall time, 90 + 40 x 24 + 30 = 1080 ms of steps
    assert step_trace.outside_ms(2.2, steps) == pytest.approx(1120.0)
    assert step_trace.outside_ms(2.2, {}) is None  # no step log
