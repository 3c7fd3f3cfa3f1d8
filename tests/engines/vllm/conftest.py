"""kvcore's tests against the real vLLM scheduler and KV-cache manager (patched release).

Run by the ``test-vllm-<short>`` nox sessions with the forked wheel installed; skipped where
vLLM (or its kvcore patch series) is not installed, e.g. in the plain ``tests`` session. The
model named by the scheduler's ``ModelConfig`` resolves from a local hub cache written here
(no network), which is why the environment is set before vLLM is imported.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

_HUB = Path(tempfile.mkdtemp(prefix="kvcore-vllm-hub-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ["HF_HUB_CACHE"] = str(_HUB)

sys.path.insert(0, str(Path(__file__).parent))


def _patched_vllm() -> bool:
    try:
        from vllm.v1.kv_cache_interface import KVCacheConfig
    except ImportError:
        return False
    return "kvcore" in getattr(KVCacheConfig, "__dataclass_fields__", {})


collect_ignore_glob: list[str] = []
if _patched_vllm():
    from hf_configs import write_hub_cache

    write_hub_cache(_HUB)
else:  # vLLM missing, or not the kvcore-patched fork
    collect_ignore_glob.append("test_elastic_*.py")
