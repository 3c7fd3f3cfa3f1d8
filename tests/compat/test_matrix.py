"""The compat matrix is well formed and the README shows its current rendering."""

from __future__ import annotations

from pathlib import Path

import pytest

from compat import matrix, render

ROOT = Path(__file__).resolve().parents[2]


def test_every_release_pins_artifacts_and_every_backend() -> None:
    releases = matrix.load()
    assert {(r.name, r.version) for r in releases} >= {
        ("vllm", "0.33.0"),
        ("vllm", "0.30.0"),
        ("sglang", "0.5.23"),
        ("sglang", "0.5.20"),
    }
    for rel in releases:
        assert set(rel.backends) == set(matrix.BACKENDS)
        assert rel.artifact("wheel", "3.11").filename.endswith(".whl")


def test_vllm_pins_its_sdist_and_sglang_one_wheel_per_python() -> None:
    vllm = matrix.find("vllm", "0.33")
    assert vllm.artifact("sdist").filename == "vllm-0.33.0.tar.gz"
    sglang = matrix.find("sglang", "0.5.23")
    names = {sglang.artifact("wheel", py).filename for py in sglang.python}
    assert len(names) == len(sglang.python)
    with pytest.raises(matrix.MatrixError, match="pins no sdist"):
        sglang.artifact("sdist")


def test_unknown_release_is_refused_with_the_pinned_list() -> None:
    with pytest.raises(matrix.MatrixError, match=r"not pinned.*vllm 0\.33\.0"):
        matrix.find("vllm", "9.9")


@pytest.mark.parametrize(
    ("needle", "replacement", "message"),
    [
        ('status = "untested"', 'status = "works"', "status 'works'"),
        ('sha256 = "f4c3', 'sha256 = "XYZ', "64 lowercase hex"),
        ("rocm = {", "metal = {", "backends.rocm is missing"),
    ],
)
def test_malformed_matrix_is_refused(
    tmp_path: Path, needle: str, replacement: str, message: str
) -> None:
    bad = tmp_path / "matrix.toml"
    bad.write_text(matrix.MATRIX_PATH.read_text().replace(needle, replacement, 1))
    with pytest.raises(matrix.MatrixError, match=message):
        matrix.load(bad)


def test_readme_holds_the_current_matrix_table() -> None:
    readme = (ROOT / "README.md").read_text()
    assert render.splice(readme) == readme, "run: python -m compat.render --write README.md"
