"""``benchmarks/kvcached_boot/sitecustomize.py`` runs a site directory's ``.pth`` files in
every interpreter started with it on ``PYTHONPATH``, and still runs the ``sitecustomize``
it shadows."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BOOT = Path(__file__).resolve().parents[2] / "benchmarks" / "kvcached_boot"


def _env_after_start(tmp_path: Path, *, site_dir: Path | None) -> dict[str, str]:
    shadowed = tmp_path / "image"
    shadowed.mkdir()
    (shadowed / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_RAN'] = '1'\n")
    env = {k: v for k, v in os.environ.items() if k != "KVCACHED_SITE"}
    env["PYTHONPATH"] = os.pathsep.join([str(BOOT), str(shadowed)])
    if site_dir is not None:
        env["KVCACHED_SITE"] = str(site_dir)
    code = "import os; print(os.environ.get('PTH_RAN'), os.environ.get('SHADOWED_RAN'))"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    return {"pth": out[0], "shadowed": out[1]}


def test_the_site_pth_files_run_and_the_shadowed_sitecustomize_too(tmp_path: Path) -> None:
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "hook.pth").write_text("import os; os.environ['PTH_RAN'] = '1'\n")
    assert _env_after_start(tmp_path, site_dir=site_dir) == {"pth": "1", "shadowed": "1"}


def test_without_kvcached_site_only_the_shadowed_one_runs(tmp_path: Path) -> None:
    assert _env_after_start(tmp_path, site_dir=None) == {"pth": "None", "shadowed": "1"}
