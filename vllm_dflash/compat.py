# SPDX-License-Identifier: Apache-2.0
"""Facts about the running vLLM: version and platform."""

from functools import cache

from packaging.specifiers import SpecifierSet
from packaging.version import Version

# The range patches declare (Patch.versions)...
SUPPORTED_VLLM = SpecifierSet(">=0.20.0,<0.24.0")
# ...and the releases actually verified by ci/matrix.toml (a unit test keeps the
# two lists equal). On any other vLLM the plugin applies nothing and says so once.
VERIFIED_VLLM: tuple[str, ...] = (
    "0.20.0",
    "0.20.1",
    "0.20.2",
    "0.21.0",
    "0.22.0",
    "0.23.0",
)


@cache
def vllm_version() -> Version:
    import vllm

    return Version(Version(vllm.__version__).base_version)


def vllm_version_str() -> str:
    import vllm

    return str(vllm.__version__)


def is_supported_vllm() -> bool:
    return str(vllm_version()) in VERIFIED_VLLM and vllm_version() in SUPPORTED_VLLM


@cache
def platform_name() -> str:
    """'cpu', 'cuda', 'rocm', ... as vLLM's current platform reports it."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type or "unknown")
