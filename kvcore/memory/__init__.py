"""The memory chain of one KV cache: layouts (``geometry``, ``families``), the virtual
cache and its zero page, page mappers, the page allocator, the block ledger and state slots,
and the one builder that opens and closes them in order (``chain``)."""
