"""``python -m patchq``: failures print the typed error with its next step and exit 1."""

from __future__ import annotations

import pytest

from patchq.__main__ import main


def test_an_unpinned_release_is_an_error_naming_the_pinned_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["materialize", "vllm", "9.9"]) == 1
    err = capsys.readouterr().err
    assert "MatrixError" in err and "vllm 9.9 is not pinned" in err


def test_a_rebase_to_continue_that_does_not_exist_says_how_to_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["rebase", "vllm", "0.0.1", "--continue"]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "ForkError" in err and "no rebase to continue" in err
    assert "next: start one: nox -s rebase-vllm -- 0.0.1" in err
