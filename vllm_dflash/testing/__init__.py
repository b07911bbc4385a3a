# SPDX-License-Identifier: Apache-2.0
"""Test and demo support: tiny deterministic checkpoints built offline."""
