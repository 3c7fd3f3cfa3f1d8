"""Suite-wide test configuration.

Tests marked ``gpu`` need a CUDA device and cuda-python's driver bindings; anywhere else
(CI, laptops) they are skipped with the reason, never failed.
"""

from __future__ import annotations

import functools

import pytest


@functools.cache
def gpu_unavailable_reason() -> str | None:
    """``None`` when a CUDA GPU with cuda-python is usable here, else why not."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return "cuda-python (cuda.bindings.driver) is not installed"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
