# SPDX-License-Identifier: Apache-2.0
from vllm_dflash.training.pipeline import main

main()
