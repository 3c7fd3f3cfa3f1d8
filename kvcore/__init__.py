"""kvcore: elastic, on-demand KV-cache memory for LLM serving engines.

Engines (vLLM, SGLang) get a *virtual* KV tensor covering their full planned capacity at a
stable address; kvcore backs it with physical GPU pages only while blocks on them are live,
and returns freed pages to the driver so another engine on the same GPU can take them.

The layers, bottom up (see DESIGN.md in the project for the full picture):

* ``kvcore.vmm``      GPU virtual-memory backends: ``cuda``, ``hip``, ``host`` (CPU, for CI).
* ``kvcore.memory.mapper``   the per-process seam that maps a page id onto physical memory.
* ``kvcore.budget.gate`` the gate a page allocator asks before taking physical memory.
* ``kvcore.errors``   every exception kvcore raises.
"""

__version__ = "0.1.0"
