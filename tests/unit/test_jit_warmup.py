# SPDX-License-Identifier: Apache-2.0
"""dflash_jit_warmup (spec_decode/jit_warmup.py): the variants it compiles, the
kernels it de-specialises, the torch.compile shapes it warms, its tripwire.

The CPU has no Triton driver, so the kernels here are recording stand-ins and
the torch.compile graphs use a counting backend; the H200 check (empty Triton
cache, no compilation after the warm-up) is in benchmarks/gpu/jit_check.py."""

from __future__ import annotations

import importlib
import inspect
import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_dflash.spec_decode import jit_warmup

MAX_REQS = 256


class RecordingKernel:
    """A Triton kernel stand-in: records warmup() calls; launching it fails."""

    def __init__(self, real: Any) -> None:
        self.real_fn = getattr(real, "fn", real)
        self.fn = SimpleNamespace(__name__=self.real_fn.__name__)
        self.calls: list[dict[str, Any]] = []

    def warmup(self, *args: Any, grid: Any, **kwargs: Any) -> None:
        bound = inspect.signature(self.real_fn).bind(*args, **kwargs)
        self.calls.append(dict(bound.arguments))

    def __getitem__(self, grid: Any):
        raise AssertionError("the warm-up launched a kernel")


def fake_runner(k: int = 15, synthetic: bool = False) -> SimpleNamespace:
    from vllm.v1.worker.block_table import MultiGroupBlockTable

    cpu = torch.device("cpu")
    tables = MultiGroupBlockTable(
        max_num_reqs=MAX_REQS, max_model_len=4096, max_num_batched_tokens=512,
        pin_memory=False, device=cpu, block_sizes=[16, 64],
        kernel_block_sizes=[16, 64], max_num_blocks=[256, 64],
    )  # fmt: skip
    drafter = SimpleNamespace(
        kv_cache_gid=1,
        input_ids=torch.zeros(64, dtype=torch.int32),
        _context_positions_buffer=torch.zeros(64, dtype=torch.int64),
        positions=torch.zeros(64, dtype=torch.int64),
        _context_slot_mapping_buffer=torch.zeros(64, dtype=torch.int64),
        _slot_mapping_buffer=torch.zeros(64, dtype=torch.int64),
        parallel_drafting_token_id=7,
        block_size=16,
    )
    rates = torch.full((k,), 0.5) if synthetic else None
    return SimpleNamespace(
        device=cpu,
        drafter=drafter,
        speculative_config=SimpleNamespace(method="dflash", num_speculative_tokens=k),
        positions=torch.zeros(512, dtype=torch.int64),
        query_start_loc=SimpleNamespace(
            gpu=torch.zeros(MAX_REQS + 1, dtype=torch.int32)
        ),
        input_batch=SimpleNamespace(
            block_table=tables,
            num_computed_tokens_cpu_tensor=torch.zeros(MAX_REQS, dtype=torch.int32),
        ),
        rejection_sampler=SimpleNamespace(
            synthetic_mode=synthetic, synthetic_conditional_rates=rates
        ),
        use_async_spec_decode=True,
        num_computed_tokens=torch.zeros(MAX_REQS, dtype=torch.int32),
        num_accepted_tokens=SimpleNamespace(
            gpu=torch.ones(MAX_REQS, dtype=torch.int32)
        ),
        prev_positions=SimpleNamespace(gpu=torch.zeros(MAX_REQS, dtype=torch.int64)),
        prev_num_draft_tokens=SimpleNamespace(
            gpu=torch.zeros(MAX_REQS, dtype=torch.int32)
        ),
    )


class Counter:
    """A torch.compile backend that counts the graphs Dynamo hands it."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        self.graphs += 1
        return gm.forward


@pytest.fixture
def kernels(monkeypatch) -> dict[str, RecordingKernel]:
    """Every kernel the warm-up reaches replaced by a recording stand-in, and
    the batch-change function compiled with a counting backend."""
    out = {}
    for module, name in [(m, n) for m, n, _ in jit_warmup.KERNELS] + [
        jit_warmup._REJECTION
    ]:
        mod = importlib.import_module(module)
        out[name] = RecordingKernel(getattr(mod, name))
        monkeypatch.setattr(mod, name, out[name])
    torch._dynamo.reset()
    counter = Counter()
    gmr = importlib.import_module(jit_warmup._BATCH_CHANGE[0])
    stock = gmr.update_num_computed_tokens_for_batch_change
    stock = getattr(stock, "_torchdynamo_orig_callable", stock)
    compiled = torch.compile(stock, dynamic=True, backend=counter)
    monkeypatch.setattr(gmr, jit_warmup._BATCH_CHANGE[1], compiled)
    out["counter"] = counter  # type: ignore[assignment]
    monkeypatch.setattr(jit_warmup, "install_tripwire", lambda: None)
    yield out
    torch._dynamo.reset()


def test_expansion_kernel_every_block_size_with_and_without_rejected_counts(kernels):
    jit_warmup.warm_up(fake_runner())
    calls = kernels["copy_and_expand_dflash_inputs_kernel"].calls
    got = {(c["BLOCK_SIZE"], c["HAS_NUM_REJECTED"]) for c in calls}
    # min(256, next_power_of_2(max_query_len + 1 + d)), max_query_len, d >= 1
    blocks = {min(256, jit_warmup.next_power_of_2(q + 1 + d)) for q in range(1, 600)
              for d in range(1, 16)}  # fmt: skip
    assert got == {(b, h) for b in blocks for h in (False, True)}
    for c in calls:  # pointer dtypes as vLLM passes them
        assert c["out_input_ids_ptr"].dtype == torch.int32
        assert c["target_positions_ptr"].dtype == torch.int64
        assert c["block_table_ptr"].dtype == torch.int32
        assert (c["num_rejected_tokens_ptr"] == 0) is not c["HAS_NUM_REJECTED"]


@pytest.mark.parametrize("k", [1, 4, 15])
def test_next_token_kernel_every_verify_length(kernels, k):
    jit_warmup.warm_up(fake_runner(k))
    calls = kernels["eagle_prepare_next_token_padded_kernel"].calls
    want = {jit_warmup.next_power_of_2(t) for t in range(1, k + 2)}
    assert {c["BLOCK_SIZE_TOKENS"] for c in calls} == want
    assert len(kernels["eagle_prepare_inputs_padded_kernel"].calls) == 1


def test_slot_mapping_through_vllm_wrapper_once_per_group(kernels):
    jit_warmup.warm_up(fake_runner())
    calls = kernels["_compute_slot_mapping_kernel"].calls
    assert len(calls) == 2  # two KV-cache groups
    assert {c["block_size"] for c in calls} == {16, 64}
    assert all(c["slot_mapping_ptr"].dtype == torch.int64 for c in calls)


@pytest.mark.parametrize("synthetic", [False, True])
def test_all_greedy_rejection_variant_without_rng_change(kernels, synthetic):
    torch.manual_seed(0)
    before = torch.get_rng_state()
    jit_warmup.warm_up(fake_runner(synthetic=synthetic))
    assert torch.equal(torch.get_rng_state(), before)
    (call,) = kernels["rejection_greedy_sample_kernel"].calls
    assert call["is_greedy_ptr"] is None  # the variant vLLM's start-up misses
    assert call["SYNTHETIC_MODE"] is synthetic
    assert (call["uniform_probs_ptr"] is None) is not synthetic
    assert call["target_argmax_ptr"].dtype == torch.int64


def serve_like_call(fn, runner, n: int, m: int) -> None:
    """As GPUModelRunner._prepare_inputs calls it, under execute_model's
    inference mode: slices of normal buffers, inference-mode counts."""
    with torch.inference_mode():
        valid = torch.ones(m, dtype=torch.int32)
        fn(
            runner.num_computed_tokens,
            runner.num_accepted_tokens.gpu[:n],
            runner.prev_positions.gpu[:n],
            valid,
            runner.prev_num_draft_tokens.gpu,
            runner.input_batch.num_computed_tokens_cpu_tensor[:n].to("cpu"),
        )


SERVE_SHAPES = [(64, 64), (63, 64), (64, 63), (1, 64), (64, 1), (1, 1), (2, 2),
                (5, 7), (MAX_REQS, MAX_REQS), (MAX_REQS, 17), (1, MAX_REQS)]  # fmt: skip


def test_batch_change_graphs_cover_every_later_batch(kernels):
    """Red without the warm-up: serving then traces new graphs."""
    runner = fake_runner()
    jit_warmup.warm_up(runner)
    counter = kernels["counter"]
    warmed = counter.graphs
    assert warmed == len(jit_warmup.batch_change_shapes(MAX_REQS)) == 4
    fn = importlib.import_module(jit_warmup._BATCH_CHANGE[0])
    fn = getattr(fn, jit_warmup._BATCH_CHANGE[1])
    for n, m in SERVE_SHAPES:
        serve_like_call(fn, runner, n, m)
    assert counter.graphs == warmed


def test_batch_change_cold_compiles_while_serving(kernels):
    """The same serving calls without the warm-up trace graphs (the check
    above can fail)."""
    runner = fake_runner()
    fn = importlib.import_module(jit_warmup._BATCH_CHANGE[0])
    fn = getattr(fn, jit_warmup._BATCH_CHANGE[1])
    for n, m in SERVE_SHAPES:
        serve_like_call(fn, runner, n, m)
    assert kernels["counter"].graphs >= 3


def test_warm_up_leaves_the_runner_state_alone(kernels):
    runner = fake_runner()
    runner.num_computed_tokens.fill_(5)
    runner.num_accepted_tokens.gpu.fill_(3)
    runner.prev_positions.gpu.copy_(torch.arange(MAX_REQS))
    jit_warmup.warm_up(runner)
    assert runner.num_computed_tokens.eq(5).all()
    assert runner.num_accepted_tokens.gpu.eq(3).all()
    assert torch.equal(runner.prev_positions.gpu, torch.arange(MAX_REQS))


def test_a_failing_step_is_skipped_and_the_rest_run(kernels):
    runner = fake_runner()
    del runner.drafter._slot_mapping_buffer
    jit_warmup.warm_up(runner)
    assert not kernels["copy_and_expand_dflash_inputs_kernel"].calls
    assert kernels["eagle_prepare_next_token_padded_kernel"].calls
    assert kernels["rejection_greedy_sample_kernel"].calls


def test_batch_change_shapes_avoid_duck_sizing():
    for reqs in (1, 2, 3, 4, 5, 256, 1024):
        shapes = jit_warmup.batch_change_shapes(reqs)
        assert (1, 1) in shapes
        for n, m in shapes:
            assert n <= reqs and m <= reqs
            assert n == 1 or (n != reqs and (m == 1 or n != m))
    assert len(jit_warmup.batch_change_shapes(256)) == 4


# ----------------------------------------------------------------- de-specialising

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _demo_kernel(x_ptr, n, stride, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


def _key(kernel, *values) -> list[Any]:
    """The specialisation Triton's binder computes for ``values``."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    return [
        native_specialize_impl(
            BaseBackend, v, False, not p.do_not_specialize,
            not p.do_not_specialize_on_alignment,
        )
        for p, v in zip([p for p in kernel.params if not p.is_constexpr], values, strict=True)
    ]  # fmt: skip


def test_despecialised_kernel_has_one_key_per_constexpr_set():
    buf = torch.zeros(64, dtype=torch.int32)
    stock = _demo_kernel
    new = jit_warmup.despecialised(stock)
    assert new.fn is stock.fn
    assert jit_warmup.runtime_args(new) == ["x_ptr", "n", "stride"]
    cases = [(buf, 1, 1), (buf[1:], 16, 17), (buf[4:], 33, 64)]
    assert len({str(_key(new, *c)) for c in cases}) == 1
    assert len({str(_key(stock, *c)) for c in cases}) == 3  # what it replaces
    assert not any(p.do_not_specialize for p in new.params if p.is_constexpr)
    assert jit_warmup.despecialised(new) is new


def test_kernels_rebound_once_in_this_process(monkeypatch):
    from triton.runtime.jit import JITFunction

    for module, name, _ in jit_warmup.KERNELS:
        mod = importlib.import_module(module)
        stock = getattr(mod, name)
        if not isinstance(stock, JITFunction):  # vLLM without a Triton driver
            monkeypatch.setattr(mod, name, JITFunction(stock))
        else:
            monkeypatch.setattr(mod, name, stock)
    jit_warmup.despecialise_kernels()
    first = [getattr(importlib.import_module(m), n) for m, n, _ in jit_warmup.KERNELS]
    jit_warmup.despecialise_kernels()
    again = [getattr(importlib.import_module(m), n) for m, n, _ in jit_warmup.KERNELS]
    assert all(a is b for a, b in zip(first, again, strict=True))
    for kernel, (_, _, args) in zip(first, jit_warmup.KERNELS, strict=True):
        assert jit_warmup.arg_names(kernel) == args
        assert all(p.do_not_specialize for p in kernel.params)


def test_probe_checks_the_argument_names():
    assert jit_warmup.probe() is True


# ------------------------------------------------------------------ tripwire


def test_tripwire_records_compiles_after_warm_up_and_chains(monkeypatch, tmp_path):
    from triton import knobs

    log = tmp_path / "jit.jsonl"
    monkeypatch.setenv("VLLM_DFLASH_JIT_LOG", str(log))
    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(kw))
    wire = jit_warmup.install_tripwire()
    assert jit_warmup.install_tripwire() is wire  # once
    fn = SimpleNamespace(name="k")
    spec = {"compile": {"specialization_data": '{"x": 1}'}}
    wire(repr="k[...]", fn=fn, is_manual_warmup=True, **spec)
    wire(repr="k[...]", fn=fn, is_manual_warmup=False, **spec)
    assert len(seen) == 2 and wire.count == 1
    (line,) = log.read_text().splitlines()
    record = json.loads(line)
    assert record["name"] == "k" and record["specialization_data"] == '{"x": 1}'


# ------------------------------------------------------------- worker wrapper


def test_worker_wrapper_only_for_dflash(monkeypatch):
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_dflash.registry import original

    calls = []
    monkeypatch.setattr(Worker, "compile_or_warm_up_model", lambda self: "stock")
    jit_warmup.apply()
    monkeypatch.setattr(
        jit_warmup, "despecialise_kernels", lambda: calls.append("re-jit")
    )
    monkeypatch.setattr(jit_warmup, "warm_up", lambda runner: calls.append("warm"))
    plain = SimpleNamespace(model_runner=SimpleNamespace(speculative_config=None))
    assert Worker.compile_or_warm_up_model(plain) == "stock"
    assert calls == []
    eagle = SimpleNamespace(
        model_runner=SimpleNamespace(
            speculative_config=SimpleNamespace(method="eagle3"), drafter=object()
        )
    )
    assert Worker.compile_or_warm_up_model(eagle) == "stock"
    assert calls == []
    dflash = SimpleNamespace(
        model_runner=SimpleNamespace(
            speculative_config=SimpleNamespace(method="dflash"), drafter=object()
        ),
        use_v2_model_runner=False,
    )
    assert Worker.compile_or_warm_up_model(dflash) == "stock"
    assert calls == ["re-jit", "warm"]
    assert original(Worker.compile_or_warm_up_model)(dflash) == "stock"
