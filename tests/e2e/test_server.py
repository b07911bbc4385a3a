# SPDX-License-Identifier: Apache-2.0
"""``vllm serve --speculative-config`` with DFlash on CPU, through the OpenAI client."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from vllm_dflash.testing.server import VllmServer, acceptance_length

pytestmark = pytest.mark.cpu_e2e

COMMON = [
    "--dtype",
    "float32",
    "--max-model-len",
    "512",
    "--enforce-eager",
    "--max-num-seqs",
    "8",
]


def _prompts() -> list[str]:
    return [
        " ".join(f"<t{4 + (i * 31 + j * 17) % 500}>" for j in range(3 + (i * 7) % 30))
        for i in range(8)
    ]


def _bench(base_url: str, model: str, tmp_path) -> dict:
    """vLLM's own ``vllm bench serve`` against the running server (the plugin
    has no benchmark of its own: vLLM's reports acceptance from /metrics)."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve",
        "--backend", "vllm", "--base-url", base_url, "--model", model,
        "--dataset-name", "random", "--random-input-len", "8",
        "--random-output-len", "16", "--num-prompts", "12", "--max-concurrency", "4",
        "--ignore-eos", "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", "bench.json", "--seed", "0",
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Acceptance length" in res.stdout, res.stdout[-3000:]
    return json.loads((tmp_path / "bench.json").read_text())


def _unexpected_tracebacks(log: str) -> list[str]:
    """Tracebacks in a server log, minus the known shutdown noise after Ctrl-C
    (SIGINT to the process group): the worker's SystemExit from vLLM's signal
    handler, with PyPI's CUDA torch on CPU its search for an NVIDIA driver, and
    the engine core's "Executor failed." when the front end's last request of its
    shutdown arrives after the worker has already exited (a race of the signal,
    seen once in 2026-12-02's CI). An executor that failed while serving fails the
    requests the tests check before the shutdown."""
    blocks = log.split("Traceback (most recent call last):")[1:]
    noise = ("SystemExit", "Found no NVIDIA driver", 'RuntimeError("Executor failed.")')
    return [
        b[:3000]
        for b in blocks
        if not any(n in b for n in noise) and not _teardown_del(b)
    ]


def _teardown_del(block: str) -> bool:
    """vLLM-CPU's oneDNN GEMM handler (``CPUDNNLGEMMHandler.__del__``, in the
    hybrid target's worker) finalised at interpreter exit, after ``torch.ops``
    is gone: "Exception ignored in ... 'NoneType' object has no attribute 'ops'"."""
    return "in __del__" in block and "object has no attribute 'ops'" in block


def _serve_and_query(
    model: str,
    tmp_path,
    tag: str,
    bench: bool = False,
    shell_args: str = "",
    env: dict[str, str] | None = None,
) -> dict:
    from openai import OpenAI

    srv = VllmServer(
        model, COMMON, env=env, log_path=tmp_path / f"{tag}.log", shell_args=shell_args
    )
    with srv:
        client = OpenAI(base_url=srv.base_url + "/v1", api_key="none")

        def complete(p: str) -> str:
            r = client.completions.create(
                model=model, prompt=p, max_tokens=24, temperature=0
            )
            return r.choices[0].text

        with ThreadPoolExecutor(4) as pool:
            completions = list(pool.map(complete, _prompts()))
        chats = [
            client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": p}],
                max_tokens=16,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .message.content
            for p in _prompts()[:2]
        ]
        metrics = srv.metrics()
        bench_result = _bench(srv.base_url, model, tmp_path) if bench else None
        metrics_end = srv.metrics()
    rc = srv.proc.returncode
    log = srv.log_path.read_text(errors="replace")
    return {
        "completions": completions,
        "chats": chats,
        "metrics": metrics,
        "bench": bench_result,
        "metrics_end": metrics_end,
        "rc": rc,
        "log": log,
    }


def _check_trace_against_metrics(records: list[dict], metrics: dict, k: int) -> None:
    """The scheduler's spec-decode counters against the drafter's own trace.

    Per request, drafting step t (``num_tokens`` n_t, drafts d_t) is verified by
    the next step, which starts at n_{t+1} = n_t + a_t + 1: a_t drafts accepted
    plus the target's token. Greedy: the accepted tokens are d_t[:a_t] and the
    target's token differs from d_t[a_t]. The last step of a request is never
    verified. So /metrics must count sum(steps - 1) drafts, k tokens each, and
    sum(a_t) accepted tokens, the per-position counts included.
    """
    by_req: dict[str, list[dict]] = {}
    for r in records:
        by_req.setdefault(r["request_id"], []).append(r)
    drafts = accepted = 0
    per_pos = [0] * k
    for steps in by_req.values():
        for cur, nxt in zip(steps[:-1], steps[1:], strict=True):
            a = nxt["num_tokens"] - cur["num_tokens"] - 1
            assert 0 <= a <= k, (cur, nxt)
            # The newest a+1 committed tokens, as far as last_token_ids shows them.
            shown = nxt["last_token_ids"][-(a + 1) :]
            new = [None] * (a + 1 - len(shown)) + shown
            draft = cur["draft_token_ids"]
            assert all(
                t is None or t == d for t, d in zip(new[:a], draft[:a], strict=True)
            ), (cur, nxt)
            assert a == k or new[a] != draft[a], (cur, nxt)  # first rejected draft
            drafts += 1
            accepted += a
            for i in range(a):
                per_pos[i] += 1
    assert metrics["vllm:spec_decode_num_drafts"] == drafts
    assert metrics["vllm:spec_decode_num_draft_tokens"] == k * drafts
    assert metrics["vllm:spec_decode_num_accepted_tokens"] == accepted
    got = [
        metrics.get(f"vllm:spec_decode_num_accepted_tokens_per_pos[{i}]", 0)
        for i in range(k)
    ]
    assert got == per_pos, (got, per_pos)


def test_serve_dflash_is_lossless(tiny_models, tmp_path):
    model = str(tiny_models.target)
    base = _serve_and_query(model, tmp_path, "base")
    # The field's command line as bash gets it once ssh has dropped the quotes:
    # bash splits the JSON at its spaces; the plugin rebuilds it.
    drafter = str(tiny_models.swa)
    assert shlex.quote(drafter) == drafter
    cfg = {"method": "dflash", "model": drafter, "num_speculative_tokens": 4}
    seed = "--speculative-config " + json.dumps(cfg)  # '{"method": "dflash", ...}'
    trace = tmp_path / "trace.jsonl"
    spec = _serve_and_query(
        model,
        tmp_path,
        "dflash",
        bench=True,
        shell_args=seed,
        env={"VLLM_DFLASH_TRACE": str(trace)},
    )
    assert "--speculative-config arrived taken apart by a shell" in spec["log"]
    assert f"rebuilt it as {json.dumps(cfg)}" in spec["log"]
    # Random tiny weights: some outputs may decode to special tokens only.
    assert sum(bool(c) for c in base["completions"] + base["chats"]) >= 6
    assert spec["completions"] == base["completions"]
    assert spec["chats"] == base["chats"]
    assert spec["metrics"].get("vllm:spec_decode_num_drafts", 0) > 0, spec["metrics"]
    assert acceptance_length(spec["metrics"]) is not None
    b = spec["bench"]
    # --ignore-eos: every request generates exactly --random-output-len tokens.
    assert b["completed"] == 12 and b["failed"] == 0, b
    assert b["total_output_tokens"] == 12 * 16, b  # 12 x 16, none stopped early
    assert b["output_throughput"] > 0 and b["median_ttft_ms"] > 0
    assert b["spec_decode_num_drafts"] > 0  # /metrics delta over the bench only
    assert b["spec_decode_draft_tokens"] == 4 * b["spec_decode_num_drafts"]
    records = [json.loads(x) for x in trace.read_text().splitlines()]
    _check_trace_against_metrics(records, spec["metrics_end"], k=4)
    for r in (base, spec):
        assert r["rc"] == 0, r["log"][-3000:]  # stopped cleanly on SIGINT
        assert not _unexpected_tracebacks(r["log"]), _unexpected_tracebacks(r["log"])[0]
