# SPDX-License-Identifier: Apache-2.0
"""Train small DFlash drafters (fixtures, demos) in plain PyTorch on the CPU."""
