# SPDX-License-Identifier: Apache-2.0
"""Start-up hook of test servers on a CUDA GPU in float32 with a hybrid target:
vLLM's GDN prefill kernels are bf16/fp16 only, so each process that imports
vLLM's GDN layer takes the plugin's float32 chunked rule instead (as
tests/helpers/offline_run.py ``--gdn-prefill-backend torch`` does in-process;
the server runs with ``--gdn-prefill-backend triton``, whose forward_native calls
the module-level kernel). This folder is on PYTHONPATH only for such servers."""

import os

if os.environ.get("VLLM_DFLASH_TEST_GDN_FP32") == "1":
    from vllm_dflash.import_hooks import when_imported

    def _install() -> None:
        import vllm.model_executor.layers.mamba.gdn_linear_attn as gdn

        from vllm_dflash.cpu import gdn_ops

        gdn.fla_chunk_gated_delta_rule = gdn_ops.chunk_gated_delta_rule

    when_imported("vllm.model_executor.layers.mamba.gdn_linear_attn", _install)
