"""kvcore's records show in vLLM's output: vLLM configures only its ``vllm`` logger, and the
adapter routes kvcore's through it (``kvcore.adapters.engine_logging``)."""

from __future__ import annotations

import logging
from logging.handlers import BufferingHandler

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="the test-vllm-* nox sessions run these")
import kvcore.adapters.vllm  # noqa: F401  (what a patched engine imports)


def test_kvcore_info_records_reach_vllms_handler() -> None:
    """As ``vllm.logger.configure_logging`` leaves it in an engine process: the ``vllm``
    logger with its own handler at INFO, not propagating; nothing on the root logger."""
    engine = logging.getLogger("vllm")
    state = (engine.handlers[:], engine.level, engine.propagate)
    kept = BufferingHandler(64)
    engine.handlers[:] = [kept]
    engine.setLevel(logging.INFO)
    engine.propagate = False
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        logging.getLogger("kvcore.adapters.vllm.memory").info("kvcore: planned %d pages", 3)
        logging.getLogger("kvcore.memory.pages").debug("below vLLM's level")
    finally:
        root.handlers[:] = saved
        engine.handlers[:], engine.level, engine.propagate = state
    assert _messages(kept) == ["kvcore: planned 3 pages"]


def _messages(handler: BufferingHandler) -> list[str]:
    return [record.getMessage() for record in handler.buffer]
