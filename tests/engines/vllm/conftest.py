"""kvcore's tests against the real vLLM scheduler and KV-cache manager (patched release).

Run by the ``test-vllm-<short>`` nox sessions with the forked wheel installed; skipped where
vLLM (or its kvcore patch series) is not installed, e.g. in the plain ``tests`` session. The
model named by the scheduler's ``ModelConfig`` resolves from a local hub cache (no network):
``harness.vllm`` sets the environment for it on import, before any test module imports vLLM.
"""

from __future__ import annotations

from harness.vllm import write_hub


def _patched_vllm() -> bool:
    try:
        from vllm.v1.kv_cache_interface import KVCacheConfig
    except ImportError:
        return False
    return "kvcore" in getattr(KVCacheConfig, "__dataclass_fields__", {})


collect_ignore_glob: list[str] = []
if _patched_vllm():
    write_hub()
else:  # vLLM missing, or not the kvcore-patched fork
    collect_ignore_glob.append("test_elastic_*.py")
