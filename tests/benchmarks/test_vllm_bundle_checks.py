"""``vllm_bundle`` stops at once, with status 2 and the install command, when a module it
needs here is missing, instead of failing after minutes of resolving and downloading."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from benchmarks import vllm_bundle


def test_a_missing_module_stops_the_bundle_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def without_tokenizers(name: str, *args: Any) -> Any:
        return None if name == "tokenizers" else find_spec(name, *args)

    def no_work(*args: Any) -> Any:
        raise AssertionError("the bundle started working")

    monkeypatch.setattr(vllm_bundle, "find_spec", without_tokenizers)
    for slow in ("resolve", "download_wheels", "_python_tree", "models_member"):
        monkeypatch.setattr(vllm_bundle, slow, no_work)
    assert "tokenizers" in vllm_bundle.missing_modules()
    out = tmp_path / "bundle"
    with pytest.raises(SystemExit) as stop:
        vllm_bundle.main(["--version", "0.33.0", "--out", str(out)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokenizers" in err
    assert "-m pip install tokenizers" in err
    assert not out.exists()
