# SPDX-License-Identifier: Apache-2.0
"""Engine-core side: scheduler patches for DFlash (applied in the engine core)."""
