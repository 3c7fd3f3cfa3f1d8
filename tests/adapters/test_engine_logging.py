"""kvcore's log records show through the engine's logger when nothing else would show them
(``kvcore.adapters.engine_logging``), and through the root logger when it has a handler."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from logging.handlers import BufferingHandler

import pytest

from kvcore.adapters.engine_logging import follow_engine_logger


@contextlib.contextmanager
def _bare_root() -> Iterator[None]:
    """The root logger without handlers, as vLLM leaves it (pytest adds its own for each
    test phase, so this is entered inside the test)."""
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()
    try:
        yield
    finally:
        root.handlers[:] = saved


@pytest.fixture
def loggers(request: pytest.FixtureRequest) -> Iterator[tuple[str, BufferingHandler]]:
    """A fresh engine logger configured like vLLM's (own handler, INFO, no propagation) and
    a fresh kvcore-like tree name."""
    name = request.node.name
    engine = logging.getLogger(f"engine-{name}")
    kept = BufferingHandler(64)
    engine.addHandler(kept)
    engine.setLevel(logging.INFO)
    engine.propagate = False
    try:
        yield name, kept
    finally:
        engine.removeHandler(kept)
        tree = logging.getLogger(f"ours-{name}")
        for handler in tree.handlers[:]:
            tree.removeHandler(handler)


def test_records_show_through_the_engine_logger_at_its_level(
    loggers: tuple[str, BufferingHandler],
) -> None:
    name, kept = loggers
    assert follow_engine_logger(f"engine-{name}", ours=f"ours-{name}")
    child = logging.getLogger(f"ours-{name}.memory")
    with _bare_root():
        child.info("planned %d pages", 7)
        child.debug("not at the engine's level")
    assert _messages(kept) == ["planned 7 pages"]


def test_a_second_call_adds_nothing(loggers: tuple[str, BufferingHandler]) -> None:
    name, kept = loggers
    assert follow_engine_logger(f"engine-{name}", ours=f"ours-{name}")
    assert not follow_engine_logger(f"engine-{name}", ours=f"ours-{name}")
    with _bare_root():
        logging.getLogger(f"ours-{name}").warning("once")
    assert _messages(kept) == ["once"]


def test_a_root_handler_takes_the_records_instead(loggers: tuple[str, BufferingHandler]) -> None:
    name, kept = loggers
    follow_engine_logger(f"engine-{name}", ours=f"ours-{name}")
    app = BufferingHandler(64)
    with _bare_root():
        logging.getLogger().addHandler(app)
        logging.getLogger(f"ours-{name}.pages").info("mapped")
    assert (_messages(app), _messages(kept)) == (["mapped"], [])


def test_an_application_handler_on_kvcore_is_left_alone(
    loggers: tuple[str, BufferingHandler],
) -> None:
    name, kept = loggers
    own = BufferingHandler(64)
    logging.getLogger(f"ours-{name}").addHandler(own)
    assert not follow_engine_logger(f"engine-{name}", ours=f"ours-{name}")
    with _bare_root():
        logging.getLogger(f"ours-{name}").warning("mine")
    assert (_messages(own), _messages(kept)) == (["mine"], [])


def _messages(handler: BufferingHandler) -> list[str]:
    return [record.getMessage() for record in handler.buffer]
