"""patchq: the patch-queue pipeline that turns pinned engine releases into kvcore forks.

Repository tooling, not part of the ``kvcore`` distribution: ``noxfile.py`` and the tests
import it from the checkout, like ``compat``. The pieces, one module each:

* ``artifacts``  find, download and sha256-verify pinned wheels/sdists (cache outside the repo)
* ``series``     ``patches/<engine>/<version>/series`` and the required patch trailers
* ``fork``       ``forks/<engine>/<version>/``: release sources as base, series via ``git am``
* ``export``     fork commits -> patch files with deterministic ``git format-patch``
* ``check``      every series applies exactly and re-exports byte for byte
* ``wheel``      the forked wheel ``<version>+kvcore.<n>`` and its install check
* ``rebase``     replay a series onto another release, with a per-patch conflict report
* ``roll``       pin a new release: fetch, rebase the nearest series, build, report
* ``errors``     ``PatchqError`` and its subclasses (context + next command)

The command line is ``python -m patchq``; see ``docs/patchq.md`` for the maintainer workflow.
"""

from patchq.errors import PatchqError
from patchq.workspace import Workspace

__all__ = ["PatchqError", "Workspace"]
