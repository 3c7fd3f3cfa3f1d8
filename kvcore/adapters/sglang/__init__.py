"""kvcore's SGLang adapter: what the ``patches/sglang/<version>/`` series calls.

* ``ElasticScope`` (``scope``) — opened by the patched ``KVCacheConfigurator`` around pool
  construction; gives the KV pools kvcore buffers and swaps in the elastic allocator.
* ``ElasticTokenToKVPoolAllocator`` / ``ElasticPagedTokenToKVPoolAllocator``
  (``allocators``) — SGLang's allocators over kvcore's block ledger; ``elastic_allocator``
  (``scope``) turns SGLang's allocator into its elastic equivalent (``swa`` for hybrid SWA).
* ``ElasticKVManager`` (``manager``) — one pool's kvcore object chain on one TP rank.
* ``ElasticConfig`` (``kvcore.adapters.config``) — the ``--kvcore-config`` options.

Importing this package imports SGLang (the allocators subclass SGLang's own).
"""

from kvcore.adapters.config import ElasticConfig
from kvcore.adapters.sglang.allocators import (
    ElasticPagedTokenToKVPoolAllocator,
    ElasticTokenToKVPoolAllocator,
)
from kvcore.adapters.sglang.manager import ElasticKVManager
from kvcore.adapters.sglang.scope import ElasticScope, elastic_allocator

__all__ = [
    "ElasticConfig",
    "ElasticKVManager",
    "ElasticPagedTokenToKVPoolAllocator",
    "ElasticScope",
    "ElasticTokenToKVPoolAllocator",
    "elastic_allocator",
]
