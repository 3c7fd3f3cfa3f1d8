"""Collect these tests only where SGLang is installed (the ``test-sglang-*`` nox sessions);
the fixtures live in ``harness.py``."""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    from tests.engines.sglang.harness import (  # noqa: F401  (fixtures and hooks)
        engines,
        kv_mode,
        make,
        pytest_collection_modifyitems,
        pytest_report_header,
    )
