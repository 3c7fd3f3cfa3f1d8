"""GPU virtual-memory backends.

``kvcore.vmm.base.VmmBackend`` is the seam; ``cuda`` (cuda-python driver API), ``hip``
(hip-python) and ``host`` (Linux memfd + mmap, for machines without a GPU) implement it.
"""
