"""Import-only stand-in for torchvision in the SGLang CPU test environment.

Registry torchvision wheels link CUDA torch and fail to load beside torch's CPU build
("operator torchvision::nms does not exist"); no CPU torchvision build matching torch 2.13.0 is
on the package registry. SGLang (through its model configs and transformers' image utilities)
imports torchvision at package import time, only for multimodal image processing that the
KV-cache tests never run. This shim makes every ``torchvision`` and ``torchvision.*`` import
succeed; *using* any of its objects raises, so no test can pass by running shim code.

It is put on ``PYTHONPATH`` only by the ``test-sglang-*`` nox sessions; it is not part of
kvcore and not installed anywhere.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any, NoReturn

__version__ = "0.0.0+kvcore.shim"


class Missing:
    """Stands for any torchvision name: attribute access chains, calling raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise RuntimeError(
            f"{self._name} was called, but torchvision here is the kvcore test import shim "
            "(tests/engines/sglang/shim); install a torchvision build matching torch to use it"
        )

    def __repr__(self) -> str:
        return f"<torchvision shim {self._name}>"


def _module_getattr(module: str) -> Any:
    def __getattr__(attr: str) -> Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{module}.{attr}")

    return __getattr__


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers every ``torchvision.<sub>`` import with a placeholder package."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.meta_path.insert(0, _SubmoduleFinder())
__getattr__ = _module_getattr(__name__)
