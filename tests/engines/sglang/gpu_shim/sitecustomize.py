"""Import-only stand-ins for SGLang's CUDA-only dependencies, on the GPU machine only.

On CUDA, SGLang imports its kernel wheels at module level (``sgl_kernel`` in quantization
schemes, sampling, ...), but the KV-cache code kvcore's GPU tests drive (pools, allocators,
radix cache) runs on SGLang's own Triton kernels and torch. Those wheels are hundreds of MB
and the GPU machine cannot install anything (``benchmarks/device_bundle.py``). There, this
directory goes first on ``PYTHONPATH`` and ``KVCORE_IMPORT_ONLY`` names the top-level
packages to stand in for (comma-separated): any name or submodule of them imports, and
calling anything raises, naming it, so a test that reaches a real kernel of theirs fails
loudly instead of passing on a stub. Never used in CPU runs (SGLang probes for these
packages to pick code paths).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from typing import Any

_NAMES = {n.strip() for n in os.environ.get("KVCORE_IMPORT_ONLY", "").split(",") if n.strip()}


class _Missing:
    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self._name}: an import-only stand-in on this machine (KVCORE_IMPORT_ONLY, "
            "tests/engines/sglang/gpu_shim); this test needs the real package"
        )

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")


class _ImportOnly(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".", 1)[0] in _NAMES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        prefix = module.__name__

        def getattr_(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Missing(f"{prefix}.{name}")

        module.__path__ = []
        module.__version__ = "0.0.0+import-only"  # type: ignore[attr-defined]
        module.__getattr__ = getattr_  # type: ignore[method-assign]


if _NAMES:
    sys.meta_path.insert(0, _ImportOnly())
