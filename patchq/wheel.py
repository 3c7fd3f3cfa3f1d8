"""The forked wheel: the pinned upstream wheel with the fork's Python sources swapped in.

``build`` materializes a scratch fork from the committed series (never the developer's fork,
so the wheel is exactly what is committed), then ``repack`` copies the upstream wheel member by
member: files the series changed or added take the fork's bytes, files it deleted are dropped,
everything else (compiled extensions included) is the release's own. The dist-info and
``.data`` directories are renamed to the local version ``<version>+kvcore.<N>`` (``N`` from
the series' ``# kvcore-build:``; 0 without a series), METADATA's ``Version:`` is rewritten,
RECORD is regenerated, the upstream filename's tags (e.g. ``manylinux_2_28``) are kept and the
WHEEL file is left as the release shipped it. Unchanged members keep their timestamps and
modes, added ones get 1980-01-01 and 0644: the same series gives the same wheel bytes.

``verify_install`` installs the result with ``--no-deps`` into a fresh venv and checks what can
be checked without the engine's dependency tree (vLLM alone needs ~50 packages to import):
``pip show`` reports the local version, every fork file is byte-identical in site-packages,
the changed modules compile, and each changed module is imported where its imports resolve (a
module whose import stops at a missing third-party dependency is reported, not failed).
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import tempfile
import venv
import zipfile
from pathlib import Path

from compat.matrix import EngineRelease
from patchq import gitcmd
from patchq.console import info, step
from patchq.errors import BuildError
from patchq.fork import UPSTREAM_REF, materialize
from patchq.series import read
from patchq.workspace import Workspace, running_python

_ADDED_DATE = (1980, 1, 1, 0, 0, 0)


def local_version(version: str, build: int) -> str:
    """The forked wheel's version: ``<version>+kvcore.<build>``."""
    return f"{version}+kvcore.{build}"


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def changes(fork: Path) -> dict[str, str]:
    """``{path: "M"|"A"|"D"}`` for every file the fork's series changes against its base."""
    listing = gitcmd.out(fork, "diff", "--name-status", "--no-renames", UPSTREAM_REF, "HEAD")
    result = {}
    for line in listing.splitlines():
        status, path = line.split("\t", 1)
        result[path] = status[0]
    return result


def _set_version(metadata: bytes, version: str) -> bytes:
    lines = metadata.decode().split("\n")
    for i, line in enumerate(lines):
        if line.startswith("Version:"):
            lines[i] = f"Version: {version}"
            return "\n".join(lines).encode()
        if not line:
            break
    raise BuildError("the upstream METADATA has no Version: header")


def repack(upstream: Path, fork: Path, dist: Path, new_version: str) -> Path:
    """Write the forked wheel of ``upstream`` with ``fork``'s changes into ``dist`` as version
    ``new_version``; return its path. Raises ``BuildError`` for a wheel without one
    dist-info directory."""
    changed = changes(fork)
    stem_parts = upstream.name[: -len(".whl")].split("-")
    name, old_version, tags = stem_parts[0], stem_parts[1], "-".join(stem_parts[-3:])
    old_prefix, new_prefix = f"{name}-{old_version}", f"{name}-{new_version}"
    out_path = dist / f"{new_prefix}-{tags}.whl"
    dist.mkdir(parents=True, exist_ok=True)
    partial = out_path.with_name(out_path.name + ".part")
    records: list[str] = []
    with zipfile.ZipFile(upstream) as zin, zipfile.ZipFile(partial, "w") as zout:
        infos = zin.infolist()
        dist_infos = {i.filename.split("/")[0] for i in infos if ".dist-info/" in i.filename}
        if dist_infos != {f"{old_prefix}.dist-info"}:
            raise BuildError(
                f"{upstream.name}: expected one {old_prefix}.dist-info, saw {dist_infos}"
            )
        record_name = f"{old_prefix}.dist-info/RECORD"
        for member in infos:
            top, sep, rest = member.filename.partition("/")
            if member.filename == record_name or changed.get(member.filename) == "D":
                continue
            if top in (f"{old_prefix}.dist-info", f"{old_prefix}.data"):
                new_name = top.replace(old_prefix, new_prefix, 1) + sep + rest
            else:
                new_name = member.filename
            data = zin.read(member)
            if member.filename in changed:
                data = (fork / member.filename).read_bytes()
            if member.filename == f"{old_prefix}.dist-info/METADATA":
                data = _set_version(data, new_version)
            out = zipfile.ZipInfo(new_name, member.date_time)
            out.external_attr = member.external_attr
            out.create_system = member.create_system
            out.compress_type = zipfile.ZIP_DEFLATED if data else zipfile.ZIP_STORED
            zout.writestr(out, data)
            if not member.is_dir():
                records.append(f"{new_name},{_record_hash(data)},{len(data)}")
        present = {m.filename for m in infos}
        for path, status in sorted(changed.items()):
            if status == "A" and path not in present:
                data = (fork / path).read_bytes()
                out = zipfile.ZipInfo(path, _ADDED_DATE)
                out.external_attr = 0o644 << 16
                out.compress_type = zipfile.ZIP_DEFLATED
                zout.writestr(out, data)
                records.append(f"{path},{_record_hash(data)},{len(data)}")
        new_record = f"{new_prefix}.dist-info/RECORD"
        records.append(f"{new_record},,")
        out = zipfile.ZipInfo(new_record, _ADDED_DATE)
        out.external_attr = 0o644 << 16
        out.compress_type = zipfile.ZIP_DEFLATED
        zout.writestr(out, "\n".join(records) + "\n")
    partial.replace(out_path)
    return out_path


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def verify_install(wheel: Path, rel: EngineRelease, fork: Path, version: str) -> list[str]:
    """Install ``wheel`` (``--no-deps``) into a fresh venv and check it against ``fork`` (see
    the module docstring). Returns notes on modules that could not be imported for missing
    dependencies. Raises ``BuildError`` on any failed check."""
    ctx = {"engine": rel.name, "version": rel.version, "file": wheel.name}
    hint = f"python -m patchq build {rel.name} {rel.version} after fixing the series"
    with tempfile.TemporaryDirectory(prefix="patchq-install-") as tmp:
        env_dir = Path(tmp) / "venv"
        venv.create(env_dir, with_pip=False)
        py = str(env_dir / "bin" / "python")
        pip = [sys.executable, "-m", "pip", "--python", py]
        with step(f"installing {wheel.name} into a fresh venv (--no-deps)"):
            proc = _run([*pip, "install", "--no-deps", "--no-index", "-q", str(wheel)])
        if proc.returncode != 0:
            raise BuildError(f"pip install failed:\n{proc.stderr.strip()}", hint=hint, **ctx)
        shown = _run([*pip, "show", rel.name]).stdout
        reported = next(
            (ln.split(":", 1)[1].strip() for ln in shown.splitlines() if ln.startswith("Version:")),
            None,
        )
        if reported != version:
            raise BuildError(f"pip show reports version {reported}, expected {version}", **ctx)
        site = Path(
            _run(
                [py, "-c", "import sysconfig; print(sysconfig.get_path('platlib'))"]
            ).stdout.strip()
        )
        for path in gitcmd.out(fork, "ls-files").splitlines():
            installed = site / path
            if not installed.is_file() or installed.read_bytes() != (fork / path).read_bytes():
                raise BuildError(
                    "the installed file differs from the fork's", hint=hint, **{**ctx, "file": path}
                )
        changed = [p for p, s in changes(fork).items() if s != "D" and p.endswith(".py")]
        if changed:
            proc = _run([py, "-m", "py_compile", *(str(site / p) for p in changed)])
            if proc.returncode != 0:
                raise BuildError(f"a patched module does not compile:\n{proc.stderr}", **ctx)
        notes = []
        for path in changed:
            module = path[: -len(".py")].replace("/", ".").removesuffix(".__init__")
            proc = _run([py, "-c", f"import {module}"])
            if proc.returncode == 0:
                continue
            last = (proc.stderr.strip().splitlines() or ["?"])[-1]
            if last.startswith("ModuleNotFoundError"):
                missing = last.split("'")[1] if "'" in last else last
                if missing.split(".")[0] != rel.name:
                    notes.append(f"{module}: not importable without its dependencies ({missing})")
                    continue
            raise BuildError(f"importing {module} fails: {last}", hint=hint, **ctx)
    return notes


def build(
    ws: Workspace,
    rel: EngineRelease,
    *,
    python: str | None = None,
    install_check: bool = True,
) -> Path:
    """Build ``rel``'s forked wheel (for ``python``, default the running interpreter) into
    ``ws.dist_dir`` from the committed series; with ``install_check``, verify it installs (only
    where the wheel fits the running interpreter). Returns the wheel path. Raises the errors of
    ``materialize``, ``BuildError`` and the artifact errors."""
    python = python or running_python()
    series = read(ws.series_dir(rel), engine=rel.name, version=rel.version)
    version = local_version(rel.version, series.build)
    upstream = ws.cache.fetch(rel, "wheel", python)
    with tempfile.TemporaryDirectory(prefix="patchq-build-") as tmp:
        fork = materialize(
            ws, rel, dest=Path(tmp) / "fork", python=python, strict=True, series=series
        )
        with step(f"repacking {upstream.name} as {version}"):
            wheel = repack(upstream, fork, ws.dist_dir, version)
        info(f"built {wheel} ({len(changes(fork))} files from {len(series.patches)} patches)")
        if install_check:
            fits = python == running_python() or "-abi3-" in upstream.name
            if not fits:
                info(f"install check skipped: the wheel is for Python {python}")
            else:
                for note in verify_install(wheel, rel, fork, version):
                    info(f"note: {note}")
                info(
                    f"install check passed: pip show {rel.name} -> {version}; fork files identical"
                )
    return wheel
