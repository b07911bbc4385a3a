# SPDX-License-Identifier: Apache-2.0
"""dflash_prefill_not_uniform_decode (vllm#49918/#53051): a prefill of 1 + k tokens
is not a speculative decode step. vLLM's own ``_determine_batch_execution_and_padding``
decides, with a dispatcher stub that records ``uniform_decode``; the H200 check
(``hybrid-swa-graph`` and its ``-stockalias`` run in benchmarks/gpu/gpu_check.py)
shows the wrong first token on a hybrid target with the patch disabled."""

import pytest

from vllm_dflash import envs
from vllm_dflash.registry import is_patched
from vllm_dflash.spec_decode import prefill_alias as pa


def test_stock_vllm_takes_a_prefill_for_a_decode():
    """The defect, as the probe sees it: 8 prompt tokens, k = 7, no drafts."""
    assert pa.probe()


def test_fix_classifies_prefill_as_mixed_and_keeps_decodes(isolated):
    """Red with VLLM_DFLASH_DISABLE=dflash_prefill_not_uniform_decode."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    isolated(pa.PATCH)
    if pa.NAME not in envs.disabled_patches():
        pa.apply()
        pa.apply()  # idempotent
        assert is_patched(
            GPUModelRunner._determine_batch_execution_and_padding, pa.NAME
        )
    determine = GPUModelRunner._determine_batch_execution_and_padding
    assert pa.classify(determine, spec_rows=0) is False  # a fresh 1+k-token prompt
    assert pa.classify(determine, spec_rows=1) is True  # a real verify step
    assert pa.classify(determine, spec_rows=None) is True  # dummy runs / capture


@pytest.mark.parametrize("method, want", [("dflash", 0), ("eagle3", None)])
def test_only_dflash_engines_are_touched(isolated, method, want):
    """execute_model records the drafted rows for DFlash only, and clears them."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    isolated(pa.PATCH)
    seen = []
    stock = lambda self, so, *a, **k: seen.append(getattr(self, pa._SPEC_ROWS, None))  # noqa: E731
    GPUModelRunner.execute_model = stock
    pa.apply()
    runner = SimpleNamespace(speculative_config=SimpleNamespace(method=method))
    GPUModelRunner.execute_model(
        runner, SimpleNamespace(scheduled_spec_decode_tokens={})
    )
    assert seen == [want]
    assert getattr(runner, pa._SPEC_ROWS, None) is None
