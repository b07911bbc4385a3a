# SPDX-License-Identifier: Apache-2.0
"""The ``vllm-dflash`` command (doctor, inspect, bench)."""
