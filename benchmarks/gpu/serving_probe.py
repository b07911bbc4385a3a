# SPDX-License-Identifier: Apache-2.0
"""Why a serving feature fails on a GPU server: one structured-output, one
invalid-schema and one logprobs request against several servers of the tiny
trained dense pair (float32, eager), started together on one GPU.

    python benchmarks/gpu/serving_probe.py OUT_DIR [--variants base,base_noplugin,...]

Variants (each its own ``vllm serve``):

- ``base``: no speculation, the plugin loaded, vLLM's default scheduling
  (asynchronous on CUDA);
- ``base_noplugin``: the same with ``VLLM_PLUGINS=none`` (vLLM alone);
- ``base_sync``: no speculation, ``--no-async-scheduling``;
- ``dflash``, ``dflash_sync``: DFlash (k = 7), default / synchronous scheduling.

Writes ``OUT_DIR/serving_probe.json``: per variant the HTTP status and body of
each request, the server log's error lines, and for logprobs the largest
difference to ``base`` (tokens equal? max |delta logprob| and where).
"""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_dflash.testing.server import VllmServer, speculative_config_arg
from vllm_dflash.testing.text_tokenizer import with_text_tokenizer
from vllm_dflash.testing.trained import ensure_trained_models
from vllm_dflash.training.data import synthetic_prompts

K = 7
COMMON = [
    "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
    "--max-num-seqs", "8", "--gpu-memory-utilization", "0.12",
    # a fixed KV cache: five servers profiling at once on one GPU see each other's
    # allocations, and one of them found no memory left for its cache
    "--kv-cache-memory-bytes", str(1 << 30),
    "--structured-outputs-config",
    json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
]  # fmt: skip
SCHEMA = {
    "type": "object",
    "properties": {"name": {"enum": ["ab", "cd"]}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
ERROR_LINE = re.compile(r"ERROR|Traceback|grammar|FSM|internal error|Error:")


def post(base_url: str, model: str, path: str, body: dict) -> tuple[int, object]:
    req = urllib.request.Request(
        base_url + path,
        data=json.dumps({"model": model, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read() or b"{}"
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, raw.decode(errors="replace")[:2000]


def requests_for(prompt: list[int]) -> dict[str, tuple[str, dict]]:
    base = {"prompt": prompt, "temperature": 0}
    return {
        "json": ("/v1/completions", {**base, "max_tokens": 60,
                                     "structured_outputs": {"json": SCHEMA}}),
        "regex": ("/v1/completions", {**base, "max_tokens": 20,
                                      "structured_outputs": {"regex": "[a-z]{2,6}-[0-9]{2}"}}),
        "bad_regex": ("/v1/completions", {**base, "max_tokens": 8,
                                          "structured_outputs": {"regex": "[a-"}}),
        "logprobs": ("/v1/completions", {**base, "max_tokens": 40, "logprobs": 3}),
    }  # fmt: skip


def json_valid(text: str) -> bool:
    """``text`` is an instance of SCHEMA."""
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(obj, dict)
        and set(obj) == {"name", "ok"}
        and obj["name"] in ("ab", "cd")
        and isinstance(obj["ok"], bool)
    )


def probe(srv: VllmServer, prompt: list[int]) -> dict:
    out: dict = {"requests": {}}
    for key, (path, body) in requests_for(prompt).items():
        t = time.monotonic()
        status, resp = post(srv.base_url, srv.model, path, body)
        entry = {"status": status, "s": round(time.monotonic() - t, 2)}
        if key == "logprobs" and status == 200:
            lp = resp["choices"][0]["logprobs"]
            entry["tokens"] = lp["tokens"]
            entry["token_logprobs"] = lp["token_logprobs"]
        elif status == 200:
            entry["text"] = resp["choices"][0]["text"]
        else:
            entry["body"] = json.dumps(resp)[:1500]
        out["requests"][key] = entry
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument(
        "--variants", default="base,base_noplugin,base_sync,dflash,dflash_sync"
    )
    ap.add_argument(
        "--server-args",
        default="",
        help="more server arguments, e.g. --log-error-stack",
    )
    args = ap.parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    trained = ensure_trained_models(root / "trained")
    target = str(with_text_tokenizer(trained.target, root / "target"))
    drafter = str(trained.dense)
    prompt = synthetic_prompts(1, (10, 30), (4, 504), seed=4242)[0]

    servers: dict[str, VllmServer] = {}
    for v in args.variants.split(","):
        extra = list(COMMON) + args.server_args.split()
        env: dict[str, str] = {}
        if v.startswith("dflash"):
            extra += speculative_config_arg(drafter, K)
        if v.endswith("_sync"):
            extra.append("--no-async-scheduling")
        if v.endswith("_noplugin"):
            env["VLLM_PLUGINS"] = "none"
        servers[v] = VllmServer(target, extra, env=env, log_path=root / f"{v}.log")

    result: dict = {"prompt_len": len(prompt), "variants": {}}
    with ThreadPoolExecutor(len(servers)) as pool:
        started = {v: pool.submit(s.__enter__) for v, s in servers.items()}
        for v, fut in started.items():
            try:
                fut.result()
                result["variants"][v] = probe(servers[v], prompt)
            except Exception as e:  # noqa: BLE001 - reported, the others go on
                result["variants"][v] = {"start_error": str(e)[:1500]}
    for v, srv in servers.items():
        srv.stop()
        lines = [x for x in srv.log_tail(4000).splitlines() if ERROR_LINE.search(x)]
        result["variants"][v]["log_errors"] = [x[:400] for x in lines[-12:]]

    ref = result["variants"].get("base", {}).get("requests", {}).get("logprobs", {})
    for v, r in result["variants"].items():
        lp = r.get("requests", {}).get("logprobs", {})
        if v == "base" or "tokens" not in lp or "tokens" not in ref:
            continue
        diffs = [
            abs(a - b)
            for a, b in zip(lp["token_logprobs"], ref["token_logprobs"], strict=False)
        ]
        worst = max(range(len(diffs)), key=diffs.__getitem__) if diffs else -1
        lp["vs_base"] = {
            "tokens_equal": lp["tokens"] == ref["tokens"],
            "max_abs_diff": max(diffs) if diffs else None,
            "at": worst,
        }
    base_reqs = result["variants"].get("base", {}).get("requests", {})
    for v, r in result["variants"].items():
        for key, e in r.get("requests", {}).items():
            if key == "json" and "text" in e:
                e["valid"] = json_valid(e["text"])
            if v != "base" and "text" in e and "text" in base_reqs.get(key, {}):
                e["text_equal_base"] = e["text"] == base_reqs[key]["text"]
    (root / "serving_probe.json").write_text(json.dumps(result, indent=1))
    for v, r in result["variants"].items():
        reqs = r.get("requests", {})
        summary = {
            k: [e["status"]]
            + [f"{f}={e[f]}" for f in ("valid", "text_equal_base") if f in e]
            for k, e in reqs.items()
        }
        vs = reqs.get("logprobs", {}).get("vs_base")
        print(f"[serving_probe] {v}: {summary or r.get('start_error', '')[:300]} "
              f"logprobs vs base: {vs}")  # fmt: skip
        for k, e in reqs.items():
            if e["status"] != 200:
                print(f"[serving_probe]   {k}: {e.get('body', '')[:600]}")
        for x in r.get("log_errors", [])[-6:]:
            print(f"[serving_probe]   log: {x[:300]}")


if __name__ == "__main__":
    main()
