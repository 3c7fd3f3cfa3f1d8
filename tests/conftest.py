"""Suite-wide test configuration.

Tests marked ``gpu`` need a CUDA device and cuda-python's driver bindings; anywhere else
(CI, laptops) they are skipped with the reason, never failed.

Nothing a test makes may outlive the suite: per-GPU ledgers and the host backend's shared
device counts go to a private directory for the whole session (``KVCORE_LEDGER_DIR``,
``KVCORE_HOST_SHARED_DIR``, inherited by every process a test starts), and the session
fails if ``/dev/shm`` holds a ``kvcore-*`` entry it did not hold before.

Property tests (hypothesis) draw the same examples on every run (``derandomize``) and keep no
example database: a run's verdict depends on the code alone. What hypothesis caches goes to
a private directory removed at the end (not ``.hypothesis/`` in the checkout). A case a
random search once found stays covered as an ``@example`` on its test;
``HYPOTHESIS_PROFILE=explore`` searches afresh.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

_HYPOTHESIS_HOME: str | None
try:  # the engine sessions' venvs (vLLM's pinned requirements) have no hypothesis
    from hypothesis import settings
    from hypothesis.configuration import set_hypothesis_home_dir
except ImportError:
    _HYPOTHESIS_HOME = None
else:
    settings.register_profile("deterministic", derandomize=True, database=None)
    settings.register_profile("explore", database=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))
    _HYPOTHESIS_HOME = tempfile.mkdtemp(prefix="kvcore-tests-hypothesis-")
    set_hypothesis_home_dir(_HYPOTHESIS_HOME)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _HYPOTHESIS_HOME is not None:
        shutil.rmtree(_HYPOTHESIS_HOME, ignore_errors=True)


_SHM = Path("/dev/shm")


def _kvcore_shm_entries() -> set[str]:
    try:
        return {p.name for p in _SHM.glob("kvcore-*")}
    except OSError:  # no /dev/shm here: nothing to leave behind
        return set()


@pytest.fixture(scope="session", autouse=True)
def _private_shared_directories() -> Iterator[None]:
    before = _kvcore_shm_entries()
    private = Path(tempfile.mkdtemp(prefix="kvcore-tests-"))
    saved = {k: os.environ.get(k) for k in ("KVCORE_LEDGER_DIR", "KVCORE_HOST_SHARED_DIR")}
    os.environ["KVCORE_LEDGER_DIR"] = str(private / "ledgers")
    os.environ["KVCORE_HOST_SHARED_DIR"] = str(private / "hostdev")
    for sub in ("ledgers", "hostdev"):
        (private / sub).mkdir(mode=0o700)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(private, ignore_errors=True)
    left = sorted(_kvcore_shm_entries() - before)
    if left:
        pytest.fail(f"the test suite left {left} in /dev/shm: a test wrote outside its directory")


@functools.cache
def gpu_unavailable_reason() -> str | None:
    """``None`` when a CUDA GPU with cuda-python is usable here, else why not."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError:
        return "cuda-python (cuda.bindings.driver) is not installed"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
