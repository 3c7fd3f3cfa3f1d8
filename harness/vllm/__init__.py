"""vLLM on a CPU machine without network, for kvcore's tests and benchmarks.

Importing this package (which importing any module of it does first) sets what vLLM and
the Hugging Face libraries read when they are imported: no hub access (``HF_HUB_OFFLINE``,
``TRANSFORMERS_OFFLINE``), the CPU platform unless one is set (``VLLM_TARGET_DEVICE``), and
``HF_HUB_CACHE`` pointing at ``HUB``, a local hub cache private to the run. The run's first
process makes ``HUB`` (and removes it when it exits); it names it in ``KVCORE_VLLM_HUB``, so
every process it starts, which inherits that, shares it. Import it before vLLM.

``write_hub()`` writes the model files vLLM's ``ModelConfig`` reads into ``HUB``
(``harness.hf_configs``). Call it once, in the process that starts the run, before any
scheduler is built: the processes it starts then read what it wrote.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

HUB_ENV = "KVCORE_VLLM_HUB"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
if HUB_ENV not in os.environ:
    os.environ[HUB_ENV] = tempfile.mkdtemp(prefix="kvcore-vllm-hub-")
    atexit.register(shutil.rmtree, os.environ[HUB_ENV], ignore_errors=True)
HUB = Path(os.environ[HUB_ENV])
os.environ["HF_HUB_CACHE"] = str(HUB)


@functools.cache
def write_hub() -> Path:
    """Write every model of ``harness.hf_configs.CONFIGS`` into ``HUB``; returns ``HUB``."""
    from harness.hf_configs import write_hub_cache

    return write_hub_cache(HUB)
