# SPDX-License-Identifier: Apache-2.0
"""VLLM_DFLASH_SHORT_VERIFY_GRAPHS (spec_decode/short_verify_graphs.py): full CUDA
graph keys for uniform batches of 1 + d tokens, the dispatch of a real step to
them, the capture with that query length, and the policy's view. vLLM's own
dispatcher, ``_determine_batch_execution_and_padding`` and ``_warmup_and_capture``
run on stand-in runners (no CUDA graphs on the CPU)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_dflash import envs
from vllm_dflash.catalog import PATCHES
from vllm_dflash.core.draft_length_policy import DraftLengthPolicy
from vllm_dflash.spec_decode import cudagraph_memory, prefill_alias
from vllm_dflash.spec_decode import short_verify_graphs as svg

K = 15
MAX_SEQS = 256
SIZES = list(range(16, 513, 16))  # a DFlash engine's sizes at k = 15 (s18 log)


def _vllm_config(mode_name: str = "FULL_AND_PIECEWISE", adaptive: bool = True):
    from vllm.config import CUDAGraphMode

    return SimpleNamespace(
        compilation_config=SimpleNamespace(
            cudagraph_mode=CUDAGraphMode[mode_name],
            cudagraph_capture_sizes=list(SIZES),
            max_cudagraph_capture_size=SIZES[-1],
            compile_sizes=[],
            cudagraph_specialize_lora=False,
            cudagraph_num_of_warmups=1,
            is_attention_compiled_piecewise=lambda: True,
            pass_config=SimpleNamespace(enable_sp=False),
            # vLLM's resolution, as a worker with full-graph attention ends it
            resolve_cudagraph_mode_and_sizes=lambda *a, **kw: CUDAGraphMode[mode_name],
        ),
        speculative_config=SimpleNamespace(
            method="dflash",
            num_speculative_tokens=K,
            use_eagle=lambda: False,  # no drafter keys in these stand-ins
            uses_extract_hidden_states=lambda: False,
        ),
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_SEQS),
        parallel_config=SimpleNamespace(
            data_parallel_size=1, use_ubatching=False, tensor_parallel_size=1
        ),
        observability_config=SimpleNamespace(cudagraph_metrics=False),
        lora_config=None,
        additional_config={"vllm_dflash": {"draft_length": "adaptive"}}
        if adaptive
        else {},
    )


def _runner(mode_name: str = "FULL_AND_PIECEWISE", adaptive: bool = True):
    """The parts of a GPUModelRunner that key init, dispatch and capture read,
    with vLLM's own dispatcher (keys initialised by vLLM)."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    config = _vllm_config(mode_name, adaptive)
    dispatcher = CudagraphDispatcher(config)
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode[mode_name], 1 + K)
    return SimpleNamespace(
        vllm_config=config,
        speculative_config=config.speculative_config,
        compilation_config=config.compilation_config,
        scheduler_config=config.scheduler_config,
        parallel_config=config.parallel_config,
        kv_cache_config=None,
        max_num_reqs=MAX_SEQS,
        max_model_len=4096,
        max_num_tokens=8192,
        num_spec_tokens=K,
        uniform_decode_query_len=1 + K,
        cudagraph_dispatcher=dispatcher,
        _is_uniform_decode=GPUModelRunner._is_uniform_decode,
        model_config=SimpleNamespace(is_encoder_decoder=False),
        input_batch=SimpleNamespace(lora_id_to_lora_request={}),
        _pad_for_sequence_parallelism=lambda n: n,
        num_decode_draft_tokens=SimpleNamespace(
            np=np.full(MAX_SEQS + 1, -1, dtype=np.int32)
        ),
    )


def _decode_step(runner, drafts: list[int]):
    """(mode, descriptor) vLLM's (patched) dispatch gives a step of decodes that
    verify ``drafts`` drafts each (-1: a row that is not a speculative decode)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    n = len(drafts)
    tokens = np.array([1 + max(d, 0) for d in drafts], dtype=np.int32)
    runner.num_decode_draft_tokens.np[:n] = drafts
    runner.num_decode_draft_tokens.np[n:] = -1
    # what dflash_prefill_not_uniform_decode's execute_model records for the step
    setattr(runner, prefill_alias._SPEC_ROWS, sum(d >= 0 for d in drafts))
    mode, desc, *_ = GPUModelRunner._determine_batch_execution_and_padding(
        runner,
        num_tokens=int(tokens.sum()),
        num_reqs=n,
        num_scheduled_tokens_np=tokens,
        max_num_scheduled_tokens=int(tokens.max()),
        use_cascade_attn=False,
    )
    return mode, desc


@pytest.fixture
def with_prefill_alias(isolated):
    """dflash_prefill_not_uniform_decode, which counts each step's drafted rows."""
    isolated(prefill_alias.PATCH)
    prefill_alias.PATCH.apply()


@pytest.fixture
def patched(with_prefill_alias, isolated, monkeypatch):
    """short_verify_graphs for 0,1,3 over prefill_alias, in catalog order
    (CUDA-only patches: applied by hand)."""
    monkeypatch.setenv(envs.VLLM_DFLASH_SHORT_VERIFY_GRAPHS, "0,1,3")
    isolated(svg.PATCH)
    svg.PATCH.apply()


def test_rounded_sizes_match_vllms_rounding():
    """The scheduler's copy of the worker's rounding agrees with vLLM's own."""
    from vllm.config import CompilationConfig

    sizes = [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120]
    for k in (3, 7, 15):
        cc = CompilationConfig(cudagraph_capture_sizes=list(sizes))
        cc.max_cudagraph_capture_size = max(sizes)
        cc.adjust_cudagraph_sizes_for_spec_decode(1 + k, 1)
        assert svg.rounded_capture_sizes(sizes, k, max(sizes)) == list(
            cc.cudagraph_capture_sizes
        ), k


def test_usable_lengths_divide_every_capture_size():
    assert svg.usable_lengths([0, 1, 2, 3, 7, 15, 20], K, SIZES) == (
        [0, 1, 3, 7],
        [2, 15, 20],
    )
    assert svg.usable_lengths([0], K, []) == ([], [0])


def test_bad_value_is_one_clear_line(monkeypatch):
    monkeypatch.setenv(envs.VLLM_DFLASH_SHORT_VERIFY_GRAPHS, "0,one")
    with pytest.raises(ValueError, match=r"VLLM_DFLASH_SHORT_VERIFY_GRAPHS='0,one'"):
        envs.short_verify_graph_lengths()
    monkeypatch.setenv(envs.VLLM_DFLASH_SHORT_VERIFY_GRAPHS, " 3,0 ,1")
    assert envs.short_verify_graph_lengths() == (0, 1, 3)


def test_keys_added_for_each_length_and_disjoint_from_vllms():
    from vllm.config import CUDAGraphMode

    runner = _runner()
    full = runner.cudagraph_dispatcher.cudagraph_keys[CUDAGraphMode.FULL]
    stock = set(full)
    assert {(d.num_tokens, d.num_reqs) for d in stock} == {(s, s // 16) for s in SIZES}
    # 2: 3 does not divide 16; the largest batch each query length's keys cover
    assert svg.add_keys(runner, (0, 1, 2, 3)) == {1: 256, 2: 512, 4: 512}
    extra = full - stock
    want = {(s, s // q) for q in (1, 2, 4) for s in SIZES if q <= s <= q * MAX_SEQS}
    assert {(d.num_tokens, d.num_reqs) for d in extra} == want
    assert len(extra) == 16 + 32 + 32
    assert all(d.uniform for d in extra)
    assert len({(d.num_tokens, d.num_reqs) for d in full}) == len(full)
    assert svg.add_keys(runner, (0, 1, 3)) == {1: 256, 2: 512, 4: 512}  # idempotent
    assert len(full - stock) == len(extra)


@pytest.mark.usefixtures("with_prefill_alias")
@pytest.mark.parametrize(
    ("mode_name", "adaptive", "reason"),
    [
        ("FULL_AND_PIECEWISE", True, None),
        ("FULL_AND_PIECEWISE", False, 'not "adaptive"'),
        ("PIECEWISE", True, "no separate full decode graphs"),
        ("FULL", True, "no separate full decode graphs"),
    ],
)
def test_off_reason(mode_name, adaptive, reason):
    runner = _runner(mode_name, adaptive)
    got = svg.off_reason(runner)
    assert (got is None) if reason is None else (reason in got), got


def test_off_without_prefill_alias():
    """The run-time check reads dflash_prefill_not_uniform_decode's count of
    drafted rows: without that patch the feature stays off (a step after a 0-draft
    one with no draft lists would find stale draft counts in the runner)."""
    assert "dflash_prefill_not_uniform_decode is not applied" in svg.off_reason(
        _runner()
    )


@pytest.mark.parametrize("max_seqs", [1, 4, 8, 24])
def test_small_max_num_seqs_never_replays_another_lengths_graph(
    patched, monkeypatch, max_seqs
):
    """vLLM caps a uniform batch's padded num_reqs at max_num_seqs; a padded size
    beyond q x max_num_seqs would then name another query length's key (helper
    review, session 20: max_num_seqs 1, 4, 8). Every FULL dispatch of a d-draft
    step must be a graph of 1 + d tokens per request."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    # 24: q = 1 has keys up to 16 tokens; 17-24 one-token rows pad to 48, and
    # vLLM's (48, min(48, 24)) is q = 2's key (48, 24)
    sizes = {1: [16, 32], 4: list(range(16, 129, 16)), 8: list(range(16, 257, 16))}
    monkeypatch.setattr(sys.modules[__name__], "MAX_SEQS", max_seqs)
    monkeypatch.setattr(sys.modules[__name__], "SIZES", sizes.get(max_seqs, [16, 48]))
    runner = _runner()
    GPUModelRunner._check_and_update_cudagraph_mode(runner, [], [])
    full = 0
    for d in (0, 1, 3, K):
        for n in range(1, max_seqs + 1):
            mode, desc = _decode_step(runner, [d] * n)
            if mode is CUDAGraphMode.FULL:
                full += 1
                assert desc.num_tokens == (1 + d) * desc.num_reqs, (d, n, desc)
    assert full  # some steps do replay full graphs


def test_step_without_draft_lists_is_not_swapped(patched):
    """One-token rows that carry no draft list this step (prefill_alias counted
    none) keep vLLM's dispatch, whatever the runner's draft counts still say."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = _runner()
    GPUModelRunner._check_and_update_cudagraph_mode(runner, [], [])
    mode, _ = _decode_step(runner, [0] * 100)
    assert mode is CUDAGraphMode.FULL
    for rows in (0, 99, None):  # counted rows: none, one short, outside a step
        setattr(runner, prefill_alias._SPEC_ROWS, rows)
        assert svg.step_query_len(runner, 100, 100, 1) is None


def test_zero_draft_step_replays_a_full_graph(patched):
    """250 decodes verifying 0 drafts each: FULL (256 tokens, 256 requests) with
    the patch, the piecewise graph without (vLLM's own)."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = _runner()
    GPUModelRunner._check_and_update_cudagraph_mode(runner, [], [])
    mode, desc = _decode_step(runner, [0] * 250)
    assert (mode, desc.num_tokens, desc.num_reqs, desc.uniform) == (
        CUDAGraphMode.FULL,
        256,
        256,
        True,
    )
    assert runner.uniform_decode_query_len == 1 + K  # restored
    assert runner.cudagraph_dispatcher.uniform_decode_query_len == 1 + K
    mode, desc = _decode_step(runner, [3] * 20)  # 80 tokens -> (80, 20)
    assert (mode, desc.num_tokens, desc.num_reqs) == (CUDAGraphMode.FULL, 80, 20)
    mode, desc = _decode_step(runner, [K] * 20)  # vLLM's own q = 16 graph
    assert (mode, desc.num_tokens, desc.num_reqs) == (CUDAGraphMode.FULL, 320, 20)


def test_first_replay_of_each_length_is_logged_once(patched, monkeypatch):
    """The evidence GPU checks grep: one line per extra length, at its first step
    dispatched to a full graph; none for steps on vLLM's own graphs."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    lines: list[str] = []
    monkeypatch.setattr(svg.logger, "info", lambda msg, *a: lines.append(msg % a))
    runner = _runner()
    GPUModelRunner._check_and_update_cudagraph_mode(runner, [], [])
    lines.clear()
    for drafts in ([0] * 250, [0] * 8, [K] * 20, [3] * 20, [0] * 10 + [1] * 10):
        _decode_step(runner, drafts)
    assert lines == [
        "DFlash: first full CUDA graph replay of a decode verifying 0 drafts "
        "(256 requests, 256 tokens)",
        "DFlash: first full CUDA graph replay of a decode verifying 3 drafts "
        "(20 requests, 80 tokens)",
    ]


@pytest.mark.parametrize(
    "drafts",
    [
        [0] * 249 + [-1],  # one row is not a speculative decode (a 1-token chunk)
        [0] * 10 + [1] * 10,  # mixed lengths
        [2] * 16,  # 3 tokens per request: no key (3 does not divide 16)
    ],
    ids=["undrafted-row", "mixed", "no-key-length"],
)
def test_other_steps_keep_vllms_graphs(patched, drafts):
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = _runner()
    GPUModelRunner._check_and_update_cudagraph_mode(runner, [], [])
    mode, desc = _decode_step(runner, drafts)
    assert mode is CUDAGraphMode.PIECEWISE and desc.num_reqs is None


def test_fixed_engine_is_unchanged(patched):
    """A fixed-k engine gets no extra keys and dispatches as vLLM does (a q = 1
    capture would take the non-speculative GDN path there)."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = _runner(adaptive=False)
    before = set(runner.cudagraph_dispatcher.cudagraph_keys[CUDAGraphMode.FULL])
    GPUModelRunner._check_and_update_cudagraph_mode(runner, [], [])
    assert runner.cudagraph_dispatcher.cudagraph_keys[CUDAGraphMode.FULL] == before
    mode, _ = _decode_step(runner, [0] * 250)
    assert mode is CUDAGraphMode.PIECEWISE


def test_query_length_restored_after_an_error():
    runner = _runner()
    with pytest.raises(KeyError), svg.query_len(runner, 1):
        assert runner.cudagraph_dispatcher.uniform_decode_query_len == 1
        raise KeyError
    assert runner.uniform_decode_query_len == 1 + K
    assert runner.cudagraph_dispatcher.uniform_decode_query_len == 1 + K


def _capturing_runner(record: list):
    runner = _runner()

    def _dummy_run(num_tokens, cudagraph_runtime_mode=None, uniform_decode=False, **_):
        q = runner.uniform_decode_query_len
        assert runner.cudagraph_dispatcher.uniform_decode_query_len == q
        record.append((num_tokens, uniform_decode, q, str(cudagraph_runtime_mode)))

    runner._dummy_run = _dummy_run
    return runner


def test_capture_uses_the_descriptors_query_length(patched):
    """vLLM's _warmup_and_capture runs each extra descriptor's warm-up and capture
    with its own query length (so _dummy_run builds q-token rows), vLLM's with
    1 + k."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import BatchDescriptor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    record: list = []
    runner = _capturing_runner(record)
    GPUModelRunner._check_and_update_cudagraph_mode(runner, [], [])
    for desc in (
        BatchDescriptor(256, 256, uniform=True),
        BatchDescriptor(256, 64, uniform=True),
        BatchDescriptor(256, 16, uniform=True),
        BatchDescriptor(256, None, uniform=False),
    ):
        GPUModelRunner._warmup_and_capture(runner, desc, CUDAGraphMode.FULL)
    qs = [q for _, _, q, _ in record]
    assert qs == [1, 1, 4, 4, 16, 16, 16, 16]  # one warm-up + one capture each
    assert runner.uniform_decode_query_len == 1 + K


def test_memory_profile_captures_through_it(isolated, monkeypatch):
    """In catalog order, dflash_cudagraph_memory_measured's capture of every graph
    goes through this patch's _warmup_and_capture (the extra graphs are captured
    with their query length and charged to the KV cache), and the step dispatch
    goes through dflash_prefill_not_uniform_decode's (a batch with a row that has
    no drafts scheduled stays piecewise)."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setenv(envs.VLLM_DFLASH_SHORT_VERIFY_GRAPHS, "0")
    chain = [
        p
        for p in PATCHES
        if p.name in (svg.NAME, cudagraph_memory.NAME, prefill_alias.NAME)
    ]
    assert [p.name for p in chain] == [
        prefill_alias.NAME,
        svg.NAME,
        cudagraph_memory.NAME,
    ]
    for p in chain:
        isolated(p)
        p.apply()
    record: list = []
    runner = _capturing_runner(record)
    GPUModelRunner._check_and_update_cudagraph_mode(runner, [], [])
    setattr(runner, cudagraph_memory._SESSION, [])
    desc = runner.cudagraph_dispatcher.get_capture_descs()[0][1][0]
    GPUModelRunner._warmup_and_capture(runner, desc, CUDAGraphMode.PIECEWISE)
    captured = {(n, q) for n, uniform, q, mode in record if uniform and "FULL" in mode}
    assert (256, 1) in captured and (512, 16) in captured
    assert len(captured) == 16 + 32  # q = 1: 16..256; q = 16: 16..512

    mode, desc = _decode_step(runner, [0] * 250)
    assert (mode, desc.num_reqs) == (CUDAGraphMode.FULL, 256)


def test_scheduler_sees_the_same_lengths(monkeypatch):
    """The policy's view (scheduler process) of which lengths have full graphs:
    the worker's rule on vLLM's rounded sizes; none for fixed engines, without
    the variable or when the patch is disabled."""
    import vllm_dflash.compat

    monkeypatch.setattr(vllm_dflash.compat, "platform_name", lambda: "cuda")
    cfg = _vllm_config()
    cfg.compilation_config.cudagraph_capture_sizes = [1, 2, 4, 8] + list(
        range(16, 513, 8)
    )
    assert svg.graph_tokens_by_length(cfg, K) == {}
    monkeypatch.setenv(envs.VLLM_DFLASH_SHORT_VERIFY_GRAPHS, "0,1,2,3")
    assert svg.graph_tokens_by_length(cfg, K) == {0: 256, 1: 512, 3: 512}
    assert svg.graph_tokens_by_length(_vllm_config(adaptive=False), K) == {}
    monkeypatch.setenv(envs.VLLM_DFLASH_DISABLE, prefill_alias.NAME)
    assert svg.graph_tokens_by_length(cfg, K) == {}
    monkeypatch.setenv(envs.VLLM_DFLASH_DISABLE, svg.NAME)
    assert svg.graph_tokens_by_length(cfg, K) == {}
    monkeypatch.delenv(envs.VLLM_DFLASH_DISABLE)
    monkeypatch.setattr(vllm_dflash.compat, "platform_name", lambda: "cpu")
    assert svg.graph_tokens_by_length(cfg, K) == {}


def test_policy_keeps_graph_lengths_out_of_the_fit():
    """A shorter length with a full graph keeps its own (lower) median, as k does:
    3 drafts at 10 ms beat 2 drafts at 14 ms although 2 is shorter."""
    times = {0: 0.009, 1: 0.012, 2: 0.014, 3: 0.010, 4: 0.020}

    def run(short_graph_tokens):
        policy = DraftLengthPolicy(
            K,
            candidates=(0, 1, 2, 3, 4, K),
            acceptance_decay=1.0,
            short_graph_tokens=short_graph_tokens,
            max_num_reqs=MAX_SEQS,
        )
        policy.tried[:] = 100.0
        policy.accepted[:] = [90.0, 80.0, 70.0] + [1.0] * (K - 3)
        bucket = policy._bucket(7)  # 64-127 requests
        for d, t in times.items():
            for _ in range(policy.probe_samples):
                policy.observe_step(100, d, t)
        return policy, policy._scores(bucket)

    policy, scores = run({0: 256, 1: 512, 3: 512})
    assert policy._bucket(7).graph == frozenset({0, 1, 3})  # 127 x 4 <= 512
    assert policy._bucket(9).graph == frozenset({0, 1})  # 256 (max) x 2 <= 512
    assert policy._bucket(8).graph == frozenset({0, 1})  # 255 x 4 > 512
    e3 = policy.expected_tokens(3)
    assert scores[3] == pytest.approx(e3 / 0.010)  # its own median
    assert scores[3] > scores[2]
    _, pooled = run({})  # without graphs: 2 and 3 pooled at 12 ms
    assert pooled[3] == pytest.approx(e3 / 0.012)


@pytest.mark.parametrize("adaptive", [True, False])
def test_gdn_capture_of_one_token_rows_takes_the_replayed_path(isolated, adaptive):
    """A q = 1 graph is captured from ``build_for_cudagraph_capture`` (every row
    1 token, so 0 drafts). In an adaptive engine (dflash_gdn_zero_draft_decodes)
    that is the speculative path, the one a padded all-0-draft step takes at
    replay, in the same buffers; in a fixed engine it would be the plain-decode
    path: why the extra graphs are for adaptive engines only."""
    from tests.unit import test_gdn_shared_metadata as gdn
    from vllm_dflash.spec_decode import gdn_zero_drafts

    isolated(gdn_zero_drafts.PATCH)
    gdn_zero_drafts.PATCH.apply()
    config = gdn._config(full_graphs=True)
    config.compilation_config.max_cudagraph_capture_size = 32
    config.additional_config = (
        {"vllm_dflash": {"draft_length": "adaptive"}} if adaptive else {}
    )
    builder = gdn._builders(config)[0]
    rows = gdn.MAX_SEQS
    table = gdn._tables(rows)[0]
    capture = builder.build_for_cudagraph_capture(
        gdn._common([1] * rows, [1] * rows, table)
    )
    if not adaptive:
        assert (capture.num_spec_decodes, capture.num_decodes) == (0, rows)
        return
    assert (capture.num_spec_decodes, capture.num_decodes) == (rows, 0)
    # a step of 5 decodes verifying 0 drafts, padded to the graph's 8 rows
    real = 5
    drafts = torch.tensor([0] * real + [-1] * (rows - real), dtype=torch.int32)
    step = builder.build(
        0,
        gdn._common(
            [1] * real + [0] * (rows - real),
            [9] * real + [0] * (rows - real),
            table,
            padded_tokens=rows,
        ),
        num_accepted_tokens=torch.ones(rows, dtype=torch.int32),
        num_decode_draft_tokens_cpu=drafts,
    )
    assert (step.num_prefills, step.num_decodes, step.num_spec_decodes) == (0, 0, real)
    for name in (
        "spec_state_indices_tensor",
        "spec_query_start_loc",
        "num_accepted_tokens",
    ):
        a, b = getattr(capture, name), getattr(step, name)
        assert a.data_ptr() == b.data_ptr() and a.shape == b.shape, name


def test_bad_value_is_refused_when_the_config_is_built(monkeypatch):
    """An adaptive engine's config refuses a malformed value in the front end, in
    one line, before any weights load (the workers read it only later)."""
    from vllm_dflash.config import draft_length
    from vllm_dflash.config.layer_types import DrafterConfigError

    vc = SimpleNamespace(
        speculative_config=SimpleNamespace(method="dflash"),
        parallel_config=SimpleNamespace(data_parallel_size=1, pipeline_parallel_size=1),
        additional_config={},
    )
    monkeypatch.setenv(envs.VLLM_DFLASH_SHORT_VERIFY_GRAPHS, "0,-1")
    draft_length.store(vc, "fixed")  # not read by fixed engines
    with pytest.raises(DrafterConfigError) as e:
        draft_length.store(vc, "adaptive")
    assert "\n" not in str(e.value)
    assert "VLLM_DFLASH_SHORT_VERIFY_GRAPHS='0,-1'" in str(e.value)
    assert "e.g. 0,1,3" in str(e.value)


def test_probe_reads_vllms_code(monkeypatch):
    """The probe looks through decorators (``_dummy_run`` is wrapped by
    ``torch.inference_mode``): on this vLLM it says "needed" when the variable is
    set, "not applicable" when it is not (session 20's second review: it read the
    decorator and failed every DFlash engine)."""
    assert svg.probe() is False
    monkeypatch.setenv(envs.VLLM_DFLASH_SHORT_VERIFY_GRAPHS, "0")
    assert svg.probe() is True


def test_profiling_keeps_the_drafted_row_count(isolated, monkeypatch):
    """dflash_step_profile (VLLM_DFLASH_PROFILE) wraps execute_model after
    dflash_prefill_not_uniform_decode: a step still goes through that patch,
    which records the drafted rows this patch and its own fix read."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_dflash.spec_decode import step_profile

    seen: list = []

    def execute_model(self, scheduler_output, *a, **kw):
        seen.append(getattr(self, prefill_alias._SPEC_ROWS, None))

    isolated(prefill_alias.PATCH)
    isolated(step_profile.PATCH)
    monkeypatch.setattr(GPUModelRunner, "execute_model", execute_model)
    monkeypatch.setenv("VLLM_DFLASH_PROFILE", "/dev/null")
    prefill_alias.PATCH.apply()
    step_profile.PATCH.apply()
    runner = SimpleNamespace(speculative_config=SimpleNamespace(method="dflash"))
    step = SimpleNamespace(scheduled_spec_decode_tokens={"a": [], "b": [1, 2]})
    GPUModelRunner.execute_model(runner, step)
    assert seen == [2]


def test_top_bucket_is_capped_at_max_num_seqs():
    """A bucket's largest batch is capped at the engine's max_num_seqs (the
    scheduler passes it): with k = 7, max_num_seqs = 64 and a 512-token capture
    limit, every batch of the 64-127 bucket (64 x 8 = 512 tokens) runs k as a
    full graph, so k keeps its own median there; uncapped it would not."""
    capped = DraftLengthPolicy(7, full_graph_tokens=512, max_num_reqs=64)
    uncapped = DraftLengthPolicy(7, full_graph_tokens=512)
    assert capped._bucket(7).graph_k and not uncapped._bucket(7).graph_k
    assert capped._bucket(6).graph_k == uncapped._bucket(6).graph_k  # 63 x 8
