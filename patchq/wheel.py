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

``verify_install`` installs the result with ``--no-deps`` into a fresh venv of the wheel's Python
and checks what can be checked without the engine's dependency tree (vLLM alone needs ~50
packages to import): ``pip show`` reports the local version, every fork file is byte-identical
in site-packages, the changed modules compile, and each changed module is imported, each in a
fresh process of its own, where its imports resolve (a module whose import stops at a missing
third-party dependency is reported, not failed; with a deps env it fails).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from compat.matrix import EngineRelease
from patchq import gitcmd
from patchq.console import info, step
from patchq.errors import BuildError
from patchq.fork import UPSTREAM_REF, materialize
from patchq.series import check_paths, read
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


class _ZipWriter:
    """A minimal zip writer that copies members of another zip *without recompressing them*
    (``zipfile`` can only recompress: 2+ minutes for vLLM's 700 MB of extensions on a busy
    2-core machine) and deflates new members. No zip64: a member or archive past 4 GiB or
    65535 members is refused."""

    def __init__(self, fh: BinaryIO) -> None:
        self._fh = fh
        self._central: list[bytes] = []

    def copy(self, src: BinaryIO, member: zipfile.ZipInfo, name: str) -> None:
        """Append ``member`` of the zip open as ``src`` under ``name``, bytes as stored."""
        if member.flag_bits & 0x1:
            raise BuildError(f"{member.filename}: encrypted zip members are not supported")
        src.seek(member.header_offset)
        header = src.read(30)
        if header[:4] != b"PK\x03\x04":
            raise BuildError(f"{member.filename}: no local header at {member.header_offset}")
        name_len, extra_len = struct.unpack("<2H", header[26:30])
        src.seek(member.header_offset + 30 + name_len + extra_len)
        self._header(name, member, member.compress_type, member.CRC, member.compress_size)
        remaining = member.compress_size
        while remaining:
            chunk = src.read(min(remaining, 1 << 20))
            if not chunk:
                raise BuildError(f"{member.filename}: truncated member data")
            self._fh.write(chunk)
            remaining -= len(chunk)

    def add(self, name: str, data: bytes, like: zipfile.ZipInfo) -> None:
        """Append ``data`` as ``name`` (deflated) with ``like``'s date and attributes."""
        if data:
            compressor = zlib.compressobj(6, zlib.DEFLATED, -15)
            stored, method = compressor.compress(data) + compressor.flush(), zipfile.ZIP_DEFLATED
        else:
            stored, method = b"", zipfile.ZIP_STORED
        info = zipfile.ZipInfo(name, like.date_time)
        info.external_attr, info.create_system, info.file_size = (
            like.external_attr,
            like.create_system,
            len(data),
        )
        self._header(name, info, method, zlib.crc32(data), len(stored))
        self._fh.write(stored)

    def _header(self, name: str, info: zipfile.ZipInfo, method: int, crc: int, size: int) -> None:
        offset = self._fh.tell()
        if max(offset, size, info.file_size) >= 0xFFFFFFFF or len(self._central) >= 0xFFFF:
            raise BuildError(f"{name}: the wheel needs zip64, which the repack does not write")
        raw = name.encode()
        flags = 0 if name.isascii() else 0x800
        year, month, day, hour, minute, second = info.date_time
        dos_date = (year - 1980) << 9 | month << 5 | day
        dos_time = hour << 11 | minute << 5 | second // 2
        fields = (flags, method, dos_time, dos_date, crc, size, info.file_size, len(raw))
        self._fh.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, *fields, 0) + raw)
        self._central.append(
            struct.pack(
                "<4s6H3L5H2L",
                b"PK\x01\x02",
                info.create_system << 8 | 20,
                20,
                *fields,
                0,
                0,
                0,
                0,
                info.external_attr,
                offset,
            )
            + raw
        )

    def close(self) -> None:
        """Write the central directory and its end record."""
        start = self._fh.tell()
        for entry in self._central:
            self._fh.write(entry)
        size, count = self._fh.tell() - start, len(self._central)
        self._fh.write(struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, size, start, 0))


def _hash_member(zin: zipfile.ZipFile, member: zipfile.ZipInfo) -> str:
    digest = hashlib.sha256()
    with zin.open(member) as fh:  # also checks the member's CRC
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return "sha256=" + base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()


def repack(upstream: Path, fork: Path, dist: Path, new_version: str) -> Path:
    """Write the forked wheel of ``upstream`` with ``fork``'s changes into ``dist`` as version
    ``new_version``; return its path. Members the series does not touch are copied as stored.
    Raises ``BuildError`` for a wheel without exactly one dist-info directory."""
    changed = changes(fork)
    stem_parts = upstream.name[: -len(".whl")].split("-")
    name, old_version, tags = stem_parts[0], stem_parts[1], "-".join(stem_parts[-3:])
    old_prefix, new_prefix = f"{name}-{old_version}", f"{name}-{new_version}"
    out_path = dist / f"{new_prefix}-{tags}.whl"
    dist.mkdir(parents=True, exist_ok=True)
    partial = out_path.with_name(out_path.name + ".part")
    records: list[tuple[str, str, str]] = []
    with (
        zipfile.ZipFile(upstream) as zin,
        open(upstream, "rb") as src,
        open(partial, "wb") as fh,
    ):
        out = _ZipWriter(fh)
        infos = zin.infolist()
        dist_infos = {i.filename.split("/")[0] for i in infos if ".dist-info/" in i.filename}
        if dist_infos != {f"{old_prefix}.dist-info"}:
            raise BuildError(
                f"{upstream.name}: expected one {old_prefix}.dist-info, saw {sorted(dist_infos)}"
            )
        record_name = f"{old_prefix}.dist-info/RECORD"
        metadata_name = f"{old_prefix}.dist-info/METADATA"
        for member in infos:
            top, sep, rest = member.filename.partition("/")
            if member.filename == record_name or changed.get(member.filename) == "D":
                continue
            if top in (f"{old_prefix}.dist-info", f"{old_prefix}.data"):
                new_name = top.replace(old_prefix, new_prefix, 1) + sep + rest
            else:
                new_name = member.filename
            if member.filename in changed or member.filename == metadata_name:
                data = (
                    _set_version(zin.read(member), new_version)
                    if member.filename == metadata_name
                    else (fork / member.filename).read_bytes()
                )
                out.add(new_name, data, member)
                records.append((new_name, _record_hash(data), str(len(data))))
            else:
                out.copy(src, member, new_name)
                if not member.is_dir():
                    digest = _hash_member(zin, member)
                    records.append((new_name, digest, str(member.file_size)))
        present = {m.filename for m in infos}
        fresh = zipfile.ZipInfo("", _ADDED_DATE)
        fresh.external_attr = 0o644 << 16
        fresh.create_system = 3
        for path, status in sorted(changed.items()):
            if status == "A" and path not in present:
                data = (fork / path).read_bytes()
                out.add(path, data, fresh)
                records.append((path, _record_hash(data), str(len(data))))
        new_record = f"{new_prefix}.dist-info/RECORD"
        records.append((new_record, "", ""))
        out.add(new_record, _record_text(records).encode(), fresh)
        out.close()
    partial.replace(out_path)
    return out_path


def _record_text(rows: list[tuple[str, str, str]]) -> str:
    """RECORD as the wheel spec wants it: CSV, so a path holding a comma or quote is quoted."""
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue()


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


# Imports one module and writes the outcome to the file named by argv[2]. One process per
# module: a failed import can leave the engine half-imported (SGLang 0.5.23: ``sglang`` is
# dropped from sys.modules while its namespace subpackage ``sglang.srt`` stays), so every later
# import in the same process fails with a misleading error (``KeyError: 'sglang'``).
_IMPORT_PROBE = """
import importlib, json, sys, traceback
try:
    importlib.import_module(sys.argv[1])
    result = None
except BaseException as exc:
    tail = traceback.format_exception(type(exc), exc, exc.__traceback__)[-6:]
    result = [type(exc).__name__, getattr(exc, "name", None) or "", str(exc), "".join(tail)]
with open(sys.argv[2], "w") as fh:
    json.dump(result, fh)
"""
IMPORT_TIMEOUT_S = 600


def _probe_imports(py: str, modules: list[str], tmp: Path) -> dict[str, list[str] | None]:
    """Import each of ``modules`` in its own fresh ``py`` process (in parallel, a few at a
    time); return ``{module: None | [kind, missing module, message, traceback tail]}``."""

    def probe(index: int, module: str) -> list[str] | None:
        out = tmp / f"probe-{index}.json"
        try:
            proc = subprocess.run(
                [py, "-c", _IMPORT_PROBE, module, str(out)],
                capture_output=True,
                text=True,
                check=False,
                timeout=IMPORT_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            return ["Timeout", "", f"no result after {IMPORT_TIMEOUT_S} s", ""]
        if not out.exists():  # the interpreter died (signal, os._exit) before reporting
            why = f"the interpreter exited with status {proc.returncode} during the import"
            return ["Crash", "", why, proc.stderr[-2000:]]
        result: list[str] | None = json.loads(out.read_text())
        return result

    workers = max(1, min(4, os.cpu_count() or 1, len(modules)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = pool.map(probe, range(len(modules)), modules)
        return dict(zip(modules, results, strict=True))


def _site(python: str) -> Path:
    proc = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('platlib'))"])
    return Path(proc.stdout.strip())


def _interpreter(python: str | None, ctx: dict[str, str]) -> str:
    """The interpreter for Python ``python`` (``"3.12"``): this one, else ``pythonX.Y`` on
    PATH. Raises ``BuildError`` when there is none: the check is not skipped silently."""
    if python is None or python == running_python():
        return sys.executable
    found = shutil.which(f"python{python}")
    probe = "import sys; print('%d.%d' % sys.version_info[:2])"
    if found is None or _run([found, "-c", probe]).stdout.strip() != python:
        # (a pyenv shim for a version that is installed but not selected does not run)
        raise BuildError(
            f"the install check of a Python {python} wheel needs a working python{python} on PATH",
            hint=f"install Python {python} (or put it on PATH), or pass --no-install-check",
            **ctx,
        )
    return found


def verify_install(
    wheel: Path,
    rel: EngineRelease,
    fork: Path,
    version: str,
    deps_env: Path | None = None,
    python: str | None = None,
) -> list[str]:
    """Install ``wheel`` (``--no-deps``) into a fresh venv of Python ``python`` (default: the
    running one; another is looked up as ``pythonX.Y`` on PATH) and check it against ``fork``
    (see the module docstring). With ``deps_env`` (a venv of that Python holding the engine's
    dependencies), its site-packages are appended to the fresh venv's path, so the changed
    modules must import for real. Returns notes on modules not importable for a missing
    third-party dependency. Raises ``BuildError`` on any failed check."""
    ctx = {"engine": rel.name, "version": rel.version, "file": wheel.name}
    hint = f"python -m patchq build {rel.name} {rel.version} after fixing the series"
    interpreter = _interpreter(python, ctx)
    with tempfile.TemporaryDirectory(prefix="patchq-install-") as tmp:
        env_dir = Path(tmp) / "venv"
        made = _run([interpreter, "-m", "venv", "--without-pip", str(env_dir)])
        if made.returncode != 0:
            raise BuildError(f"{interpreter} -m venv failed:\n{made.stderr.strip()}", **ctx)
        py = str(env_dir / "bin" / "python")
        pip = [sys.executable, "-m", "pip", "--python", py]
        where = f"a fresh Python {python or running_python()} venv"
        with step(f"installing {wheel.name} into {where} (--no-deps)"):
            flags = ["--no-deps", "--no-index", "--no-compile", "-q"]
            proc = _run([*pip, "install", *flags, str(wheel)])
        if proc.returncode != 0:
            raise BuildError(f"pip install failed:\n{proc.stderr.strip()}", hint=hint, **ctx)
        shown = _run([*pip, "show", rel.name]).stdout
        reported = next(
            (ln.split(":", 1)[1].strip() for ln in shown.splitlines() if ln.startswith("Version:")),
            None,
        )
        if reported != version:
            raise BuildError(f"pip show reports version {reported}, expected {version}", **ctx)
        site = _site(py)
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
        if deps_env is not None:
            (site / "_patchq_deps.pth").write_text(f"{_site(str(deps_env / 'bin' / 'python'))}\n")
        modules = [p[: -len(".py")].replace("/", ".").removesuffix(".__init__") for p in changed]
        with step(f"importing the {len(modules)} changed modules, one process each"):
            failures = _probe_imports(py, modules, Path(tmp))
        notes = []
        for module, failure in failures.items():
            if failure is None:
                continue
            kind, missing, text, trace = failure
            third_party = kind == "ModuleNotFoundError" and missing.split(".")[0] != rel.name
            if third_party and deps_env is None:
                notes.append(f"{module}: not importable without its dependencies ({missing})")
                continue
            where = f"\n{trace.rstrip()}" if trace else ""
            fix = hint
            if third_party:  # with a deps env: the env is incomplete, not (yet) the series
                fix = (
                    f"install {missing.split('.')[0]}'s distribution into {deps_env} "
                    '(docs/patchq.md, "The install check"), then build again'
                )
            raise BuildError(f"importing {module} fails: {kind}: {text}{where}", hint=fix, **ctx)
    return notes


def build(
    ws: Workspace,
    rel: EngineRelease,
    *,
    python: str | None = None,
    install_check: bool = True,
    deps_env: Path | None = None,
) -> Path:
    """Build ``rel``'s forked wheel (for ``python``, default the running interpreter) into
    ``ws.dist_dir`` from the committed series; with ``install_check``, verify it installs into
    a venv of that Python (``pythonX.Y`` on PATH when it is not the running one; none is a
    ``BuildError``). Returns the wheel path. Raises the errors of
    ``materialize``, ``BuildError`` and the artifact errors."""
    python = python or running_python()
    series = read(ws.series_dir(rel), engine=rel.name, version=rel.version)
    check_paths(series, engine=rel.name, version=rel.version)
    version = local_version(rel.version, series.build)
    upstream = ws.cache.fetch(rel, "wheel", python)
    with tempfile.TemporaryDirectory(prefix="patchq-build-") as tmp:
        fork = materialize(ws, rel, dest=Path(tmp) / "fork", python=python, series=series)
        with step(f"repacking {upstream.name} as {version}"):
            wheel = repack(upstream, fork, ws.dist_dir, version)
        info(f"built {wheel} ({len(changes(fork))} files from {len(series.patches)} patches)")
        if install_check:
            for note in verify_install(wheel, rel, fork, version, deps_env, python):
                info(f"note: {note}")
            info(
                f"install check passed (Python {python}): pip show {rel.name} -> {version}; "
                "fork files identical"
            )
    return wheel
