# SPDX-License-Identifier: Apache-2.0
"""Kernels of the layer patches: torch (CPU, reference) and Triton (CUDA)."""
