"""``docs/architecture.md``'s map of the code matches the tree: every public module of the
package is named there (by its path under ``kvcore/``, or a folder above it), and every path
the map names exists; so does every test file the invariants table names."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvcore"
DOC = (ROOT / "docs" / "architecture.md").read_text()
MAP = DOC[DOC.index("## Layers and the map of the code") : DOC.index("## Ownership")]
# the map's table rows: "| layer | `path`, `path` | what it holds |"
_ROW = re.compile(r"^\|[^|]*\|([^|]*)\|", re.M)
NAMED = {path for cell in _ROW.findall(MAP) for path in re.findall(r"`([\w/]+(?:\.py|/))`", cell)}


def test_every_public_module_is_on_the_map() -> None:
    missing = []
    for module in sorted(PACKAGE.rglob("*.py")):
        rel = module.relative_to(PACKAGE)
        if module.name == "__init__.py" or module.name.startswith("_"):
            continue
        folders = {f"{'/'.join(rel.parts[:i])}/" for i in range(1, len(rel.parts))}
        if rel.as_posix() not in NAMED and not folders & NAMED:
            missing.append(rel.as_posix())
    assert not missing, f"docs/architecture.md's map does not name: {missing}"


def test_every_path_on_the_map_exists() -> None:
    assert NAMED, "no paths found in docs/architecture.md's map"
    gone = sorted(p for p in NAMED if not (PACKAGE / p).exists())
    assert not gone, f"docs/architecture.md's map names paths that do not exist: {gone}"


def test_every_test_the_invariants_table_names_exists() -> None:
    table = DOC[DOC.index("## Invariants") : DOC.index("## Layouts")]
    named = set(re.findall(r"`(tests/[\w/]+(?:\.py|/))`", table))
    assert named
    gone = sorted(p for p in named if not (ROOT / p).exists())
    assert not gone, f"docs/architecture.md's invariants table names missing tests: {gone}"
