# SPDX-License-Identifier: Apache-2.0
"""The ``vllm-dflash`` command."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from vllm_dflash.version import __version__


def _hybrid_prefix_caching() -> str:
    """Whether a DFlash engine on a hybrid target may enable prefix caching here
    (the start-up check of ``hybrid_align_budget_check`` runs the same tests)."""
    from vllm_dflash.core.hybrid_cache_hit import exact_hits
    from vllm_dflash.registry import gate
    from vllm_dflash.spec_decode import hybrid_align_accepted_order as align_order

    try:
        exact = exact_hits()
    except Exception as e:  # another vLLM's KV-cache manager
        return f"not checked on this vLLM ({type(e).__name__}: {e})"
    if not exact:
        return "refused at start-up (prefix-cache hits are not exact on this vLLM)"
    blocked = gate(align_order.PATCH)
    if blocked is not None:
        return (
            "lossless with synchronous scheduling only; with asynchronous "
            f"scheduling refused at start-up ({align_order.NAME} "
            f"{blocked.state.value})"
        )
    from vllm_dflash.layers import gdn_state_replay

    replay = gate(gdn_state_replay.PATCH)
    memory = (
        "one GDN state + record ring a request (dflash_gdn_state_replay; measured "
        "exact on CPU and in float32 on CUDA: docs/hybrid.md)"
        if replay is None
        else f"vLLM's 1 + k GDN states a request (dflash_gdn_state_replay "
        f"{replay.state.value}; measured exact on CPU and in float32 on CUDA), so "
        "fewer requests fit"
    )
    return (
        "lossless (prefix-cache hits are exact; async scheduling included; "
        f"docs/hybrid.md); {memory}"
    )


def _doctor(args: argparse.Namespace) -> int:
    # vLLM logs to stdout; keep stdout for the report (``--json`` stays parseable).
    with contextlib.redirect_stdout(sys.stderr):
        from vllm_dflash.catalog import PATCHES
        from vllm_dflash.compat import platform_name, vllm_version_str
        from vllm_dflash.entrypoints.cli.environment import structured_outputs
        from vllm_dflash.registry import apply_all

        results = apply_all(PATCHES, defer=False)
        hybrid_pc = _hybrid_prefix_caching()
        structured = structured_outputs()
    report = {
        "vllm_dflash": __version__,
        "vllm": vllm_version_str(),
        "platform": platform_name(),
        "hybrid_prefix_caching": hybrid_pc,
        "structured_outputs": structured,
        "patches": [
            {
                "name": p.name,
                "kind": p.kind.value,
                "state": results[p.name].state.value,
                "reason": results[p.name].reason,
                "targets": list(p.targets),
                "upstream": p.upstream,
                "versions": p.versions,
                "summary": p.summary,
                "why": p.why,
                "future": p.future,
            }
            for p in PATCHES
        ],
    }
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(
            f"vllm-dflash {__version__} | vLLM {report['vllm']} | platform {report['platform']}"
        )
        print(f"DFlash + prefix caching on hybrid targets: {hybrid_pc}")
        print(f"Structured outputs (this vLLM install): {structured}")
        width = max(len(p["name"]) for p in report["patches"])
        for p in report["patches"]:
            extra = f" ({p['reason']})" if p["reason"] else ""
            print(f"  {p['name']:<{width}}  {p['state']}{extra}")
            print(f"  {'':<{width}}  {p['summary']} [{p['upstream']}]")
    failed = [p["name"] for p in report["patches"] if p["state"] == "failed"]
    return 1 if failed else 0


def _inspect(args: argparse.Namespace) -> int:
    from vllm_dflash.config.layer_types import DrafterConfigError
    from vllm_dflash.entrypoints.cli.inspect_drafter import (
        format_report,
        inspect_drafter,
    )

    memory = {
        "num_speculative_tokens": args.num_speculative_tokens,
        "kv_cache_dtype": args.kv_cache_dtype,
        "context": args.context,
        "gpu_memory_gib": args.gpu_memory_gib,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "overhead_gib": args.overhead_gib,
        "tensor_parallel_size": args.tensor_parallel_size,
        "want_concurrency": args.want_concurrency,
        "gdn_replay": not args.vllm_gdn_copies,
        "prefix_caching": args.prefix_caching,
    }
    try:
        report = inspect_drafter(args.drafter, args.target, memory=memory)
    except (DrafterConfigError, FileNotFoundError, KeyError) as e:
        print(f"vllm-dflash inspect: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm-dflash", description="DFlash speculative decoding for vLLM 0.20.x"
    )
    parser.add_argument(
        "--version", action="version", version=f"vllm-dflash {__version__}"
    )
    sub = parser.add_subparsers(dest="command")
    doctor = sub.add_parser("doctor", help="vLLM version, platform and patch states")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    ins = sub.add_parser(
        "inspect", help="resolved DFlash settings of a drafter checkpoint"
    )
    ins.add_argument(
        "drafter", help="local drafter directory (config.json + safetensors)"
    )
    ins.add_argument(
        "--target",
        help="local target directory (config.json) to validate against; also "
        "prints the KV / GDN-state memory per request",
    )
    ins.add_argument("--json", action="store_true")
    mem = ins.add_argument_group("memory (with --target; configs only)")
    mem.add_argument(
        "-k",
        "--num-speculative-tokens",
        type=int,
        help="draft tokens per step (default: block_size - 1)",
    )
    mem.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8"]
    )
    mem.add_argument(
        "--context", type=int, default=8192, help="tokens per request (max_model_len)"
    )
    mem.add_argument(
        "--gpu-memory-gib", type=float, help="GPU memory per GPU (H200: 140.4)"
    )
    mem.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    mem.add_argument(
        "--overhead-gib",
        type=float,
        default=3.2,
        help="non-KV peak besides the weights (3.2: the 27B-shaped target on an H200)",
    )
    mem.add_argument("--tensor-parallel-size", type=int, default=1)
    mem.add_argument(
        "--vllm-gdn-copies",
        action="store_true",
        help="hybrid targets: vLLM's 1 + k GDN state copies per request (the "
        "plugin's dflash_gdn_state_replay disabled) instead of one state + ring",
    )
    mem.add_argument(
        "--prefix-caching",
        action="store_true",
        help="hybrid targets: vLLM's 'align' mamba cache mode (one GDN page more "
        "per request)",
    )
    mem.add_argument(
        "--want-concurrency",
        type=float,
        help="suggest the k / memory that hold this many requests",
    )
    args = parser.parse_args(argv)
    if args.command == "doctor":
        return _doctor(args)
    if args.command == "inspect":
        return _inspect(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
