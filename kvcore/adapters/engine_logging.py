"""kvcore's log records, shown where the engine shows its own.

vLLM configures only its ``vllm`` logger (its own handler and format, ``propagate`` off) and
leaves the root logger bare, so records of ``kvcore.*`` loggers would reach Python's
last-resort handler, which prints warnings and errors only: kvcore's start-up plan and its
shutdown summary (INFO) would never be seen. ``follow_engine_logger`` hands them to the
engine's logger while the root logger has no handler, so they carry the engine's format and
process prefix and obey its level (``VLLM_LOGGING_LEVEL``). An application that configures
logging itself (a root handler: ``logging.basicConfig``, pytest's ``caplog``) gets kvcore's
records, INFO and above, through the root logger, once.
"""

from __future__ import annotations

import logging

__all__ = ["follow_engine_logger"]

KVCORE_LOGGER = "kvcore"


class _ToEngineLogger(logging.Handler):
    """Hands each record to the engine's logger as it is at emit time (the engine may
    reconfigure its handlers after kvcore was imported), unless the root logger handles
    records (they propagate there) or the engine's logger has no handler of its own."""

    def __init__(self, engine: logging.Logger) -> None:
        super().__init__()
        self.engine = engine

    def emit(self, record: logging.LogRecord) -> None:
        engine = self.engine
        if logging.getLogger().handlers or not engine.handlers:
            return
        if engine.isEnabledFor(record.levelno):
            engine.handle(record)


def follow_engine_logger(engine_logger: str, *, ours: str = KVCORE_LOGGER) -> bool:
    """Show records of the ``kvcore`` logger tree through the logger named
    ``engine_logger`` (for vLLM: ``"vllm"``) at that logger's level, while the root logger
    has no handler. Unless it has a level, the ``kvcore`` logger gets INFO (or the engine
    logger's, if lower): engines may configure their logger after kvcore is imported. Called when
    an engine adapter is imported. Returns ``False`` (and does nothing) when the ``kvcore``
    logger already has a handler (the application's, or this one), ``True`` otherwise.
    ``ours`` names the logger tree to route (kvcore's by default). Raises nothing."""
    tree = logging.getLogger(ours)
    if tree.handlers:
        return False
    engine = logging.getLogger(engine_logger)
    tree.addHandler(_ToEngineLogger(engine))
    if tree.level == logging.NOTSET:  # INFO unless the engine logs more; it filters again
        tree.setLevel(min(engine.getEffectiveLevel(), logging.INFO))
    return True
