"""kvcore: elastic, on-demand KV-cache memory for LLM serving engines.

Engines (vLLM, SGLang) get a *virtual* KV tensor covering their full planned capacity at a
stable address; kvcore backs it with physical GPU pages only while blocks on them are live,
and returns freed pages to the driver so another engine on the same GPU can take them.

The layers, bottom up; each imports only those below it (``docs/architecture.md`` has the
map of every module):

* ``kvcore.vmm``       GPU virtual-memory backends: ``cuda``, ``hip``, ``host`` (CPU, for CI).
* ``kvcore.budget``    the memory gate a page allocator asks, and the per-GPU ledger.
* ``kvcore.memory``    virtual cache, page mappers, page allocator, block ledger, layouts.
* ``kvcore.parallel``  TP x PP: the worker channel; agreement across ranks.
* ``kvcore.adapters``  what the vLLM and SGLang patch series call.
* ``kvcore.cli``       ``kvctl`` and ``kvtop``; ``kvcore.metrics`` for Prometheus.
* ``kvcore.errors``    every exception kvcore raises.
"""

__version__ = "0.1.0"
