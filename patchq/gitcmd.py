"""Running git for forks with a fixed identity, fixed dates and no user configuration.

Every git call of the tooling goes through ``git()``: the user's and the system's git
configuration are ignored (a ``diff.noprefix`` or ``format.signature`` in someone's
``~/.gitconfig`` must not change an exported patch), the committer is the fixed patchq identity
at a fixed date, and the locale is C so messages parse the same everywhere.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from patchq.errors import GitError

NAME = "kvcore patchq"
EMAIL = "patchq@kvcore.invalid"
# Every commit patchq makes (bases, applied patches) carries this committer date, so the same
# release and series give the same commit ids on every machine.
EPOCH = "946684800 +0000"  # 2000-01-01T00:00:00Z

_INHERITED_GIT_VARS = (
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_CEILING_DIRECTORIES",
    "GIT_COMMON_DIR",
)


def git_env(*, author_date: bool = False) -> dict[str, str]:
    """The environment for git in a fork: no global/system config, fixed committer; with
    ``author_date`` the author is fixed too (base commits)."""
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED_GIT_VARS}
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        LC_ALL="C",
        LANG="C",
        GIT_TERMINAL_PROMPT="0",
        GIT_COMMITTER_NAME=NAME,
        GIT_COMMITTER_EMAIL=EMAIL,
        GIT_COMMITTER_DATE=EPOCH,
    )
    if author_date:
        env.update(GIT_AUTHOR_NAME=NAME, GIT_AUTHOR_EMAIL=EMAIL, GIT_AUTHOR_DATE=EPOCH)
    return env


def git(
    repo: Path,
    *args: str,
    input: bytes | None = None,
    check: bool = True,
    author_date: bool = False,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``git -C repo args`` with ``git_env``; stdout and stderr are captured. Raises
    ``GitError`` (command, output) when ``check`` and git exits non-zero."""
    cmd = ["git", "-C", str(repo), *args]
    proc = subprocess.run(
        cmd, input=input, capture_output=True, env=git_env(author_date=author_date), check=False
    )
    if check and proc.returncode != 0:
        output = (proc.stdout + proc.stderr).decode(errors="replace")
        raise GitError(
            f"`git {' '.join(args[:3])}` failed (exit {proc.returncode}):\n{output.strip()}",
            command=cmd,
            output=output,
            hint=f"inspect the repository: git -C {repo} status",
        )
    return proc


def out(repo: Path, *args: str) -> str:
    """The stripped stdout of a successful ``git -C repo args``."""
    return git(repo, *args).stdout.decode().strip()
