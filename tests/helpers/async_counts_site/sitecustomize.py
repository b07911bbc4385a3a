# SPDX-License-Identifier: Apache-2.0
"""Start-up hook of test processes run with ``offline_run.py
--async-accepted-counts``: vLLM-CPU spawns its worker, so the worker installs
tests/helpers/async_counts.py itself, when it imports the model runner. This
folder is on PYTHONPATH only for such runs."""

import os

if os.environ.get("VLLM_DFLASH_TEST_ASYNC_COUNTS") == "1":
    from vllm_dflash.import_hooks import when_imported

    def _install() -> None:
        from tests.helpers import async_counts

        async_counts.install()

    when_imported("vllm.v1.worker.gpu_model_runner", _install)
