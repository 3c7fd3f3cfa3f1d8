"""Start-up hook that turns kvcached on in every Python process of a ``vllm serve``.

kvcached activates through ``kvcached_autopatch.pth``, which registers its vLLM patches when
``vllm`` is imported. Python reads ``.pth`` files only in site directories, and the GPU
machine's bundles put packages on ``PYTHONPATH``, so the hook would never run; vLLM's engine
core is a fresh interpreter, so adding the site in the launching process is not enough. With
this directory first on ``PYTHONPATH``, every interpreter imports this module at start-up:
it adds ``$KVCACHED_SITE`` as a site directory (running its ``.pth`` files), then runs the
``sitecustomize`` this one shadows, if the image has one. Without ``KVCACHED_SITE`` it does
nothing but that.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import site
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_site = os.environ.get("KVCACHED_SITE")
if _site:
    site.addsitedir(_site)

_rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _shadowed = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_shadowed)
