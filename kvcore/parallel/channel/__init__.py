"""The engine <-> worker channel for tensor- and pipeline-parallel engines (vLLM).

The engine process decides every page transition; each GPU worker (TP x PP rank) owns its
virtual KV tensors and must apply the same transition at the same offset, or none
(``docs/channel.md``). Modules, one concept each:

* ``endpoints``    per-instance socket directory, rank -> socket path, peer checks, cleanup
* ``messages``     the typed wire schema and its framing (no pickle)
* ``transactions`` per-transaction-id outcomes a worker remembers
* ``worker``       ``WorkerListener``: the thread a worker runs to apply transitions
* ``coordinator``  ``ChannelCoordinator``: the engine-side ``PageMapper``
"""

from kvcore.parallel.channel.coordinator import ChannelCoordinator
from kvcore.parallel.channel.endpoints import (
    CHANNEL_ENV,
    ChannelDirectory,
    channel_dir_from_env,
    reclaim_stale,
    socket_path,
)
from kvcore.parallel.channel.worker import WorkerListener

__all__ = [
    "CHANNEL_ENV",
    "ChannelCoordinator",
    "ChannelDirectory",
    "WorkerListener",
    "channel_dir_from_env",
    "reclaim_stale",
    "socket_path",
]
