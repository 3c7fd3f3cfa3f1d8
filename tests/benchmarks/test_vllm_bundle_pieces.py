"""A bundle member larger than a part travels in pieces and is joined on the GPU machine:
``vllm_bundle.split_member`` / ``pack_parts`` here, ``vllm_device.sh unpack`` there (run here on
a tiny bundle, its parts unpacked in reverse order, one call each); ``pack`` folds a call's
output into one tar there."""

from __future__ import annotations

import io
import lzma
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from benchmarks import vllm_bundle

ROOT = Path(__file__).resolve().parents[2]


def test_a_large_member_is_split_and_joined_back_whatever_the_part_order(
    tmp_path: Path,
) -> None:
    payload = os.urandom(300_000)  # incompressible: the .xz stays about this large
    staged = tmp_path / "staged"
    staged.mkdir()
    big = staged / "vllm%_big_kernel.abi3.so.xz"
    big.write_bytes(lzma.compress(payload))
    small = staged / "vllm%_small.abi3.so.xz"
    small.write_bytes(lzma.compress(b"small"))
    out = tmp_path / "out"
    out.mkdir()
    limit = 128 << 10
    parts = vllm_bundle.pack_parts([big, small], out, limit)
    names = [p.name for members in parts for p in members]
    assert big.name not in names and sum(n.startswith(big.name + ".") for n in names) == 3
    tars = sorted(out.glob("part-*.tar"))
    assert all(t.stat().st_size <= limit for t in tars)
    kvdev = tmp_path / "kvdev"
    for tar in reversed(tars):  # the pieces arrive in any order
        subprocess.run(
            ["bash", str(ROOT / "benchmarks" / "vllm_device.sh"), "unpack", str(tar)],
            env={**os.environ, "KVDEV": str(kvdev)},
            check=True,
            capture_output=True,
        )
    assert (kvdev / "site" / "vllm" / "_big_kernel.abi3.so").read_bytes() == payload
    assert (kvdev / "site" / "vllm" / "_small.abi3.so").read_bytes() == b"small"
    assert list((kvdev / "pieces").iterdir()) == []  # joined pieces are not kept


def test_a_member_that_fits_is_not_split(tmp_path: Path) -> None:
    f = tmp_path / "models.tar.xz"
    f.write_bytes(b"x" * 1000)
    assert vllm_bundle.split_member(f, 1 << 20) == [f]


def test_only_the_pinned_wheels_of_the_cache_are_bundled(tmp_path: Path) -> None:
    """The wheel cache is kept between runs: a wheel of an earlier resolution (another
    version of a pinned package) stays out of the bundle, where pip would refuse the pair."""
    cache = tmp_path / "wheels"
    cache.mkdir()
    for name in ("anthropic-2.14.0-py3-none-any.whl", "anthropic-2.15.0-py3-none-any.whl",
                 "Annotated_Types-0.8.0-py3-none-any.whl"):  # fmt: skip
        (cache / name).write_bytes(b"")
    picked = [("annotated-types", "0.8.0", "file:///a"), ("anthropic", "2.15.0", "file:///b")]
    wheels = vllm_bundle.download_wheels(picked, "3.12", cache)  # all cached: pip is not run
    assert [w.name for w in wheels] == [
        "Annotated_Types-0.8.0-py3-none-any.whl",
        "anthropic-2.15.0-py3-none-any.whl",
    ]


def test_parts_leave_room_for_the_checkout_a_call_carries_with_them(tmp_path: Path) -> None:
    """A device call carries 64 MiB, the checkout included: the default part size is what
    is left beside the checkout (tracked and untracked files, never ignored ones), less a
    margin for it to grow."""
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / ".gitignore").write_text(".vdev/\n")
    (repo / "tracked.bin").write_bytes(b"\0" * (3 << 20))
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "c"], check=True)
    (repo / "untracked.bin").write_bytes(b"\0" * (1 << 20))
    (repo / ".vdev").mkdir()
    (repo / ".vdev" / "part-1.tar").write_bytes(b"\0" * (5 << 20))  # ignored: not carried
    carried = vllm_bundle.checkout_bytes(repo)
    assert carried == (4 << 20) + len(".vdev/\n")
    part = vllm_bundle.default_part_mib(carried)
    assert part == vllm_bundle.CALL_MIB - 5 - vllm_bundle.CHECKOUT_MARGIN_MIB
    assert (part << 20) + carried <= vllm_bundle.CALL_MIB << 20


def test_pack_folds_a_calls_output_into_one_tar_and_adds_to_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / "pyspy").mkdir(parents=True)
    for i in range(10):  # more files than the device tool brings back
        (out / f"run-{i}.json").write_text(str(i))
    (out / "pyspy" / "scheduler.txt").write_text("stacks")

    def pack(script: str) -> None:
        subprocess.run(
            ["bash", str(ROOT / "benchmarks" / script), "pack"],
            env={**os.environ, "OUT": str(out)},
            check=True,
            capture_output=True,
        )

    pack("sglang_device.sh")
    assert [p.name for p in out.iterdir()] == ["results.tar"]
    (out / "late.log").write_text("late")
    pack("vllm_device.sh")  # a second pack in the same call appends
    assert [p.name for p in out.iterdir()] == ["results.tar"]
    with tarfile.open(out / "results.tar") as tar:
        names = sorted(tar.getnames())
        assert tar.extractfile("./pyspy/scheduler.txt").read() == b"stacks"  # type: ignore[union-attr]
    assert names == sorted(
        [f"./run-{i}.json" for i in range(10)] + ["./pyspy/scheduler.txt", "./late.log"]
    )


def _wheel(path: Path, name: str, module: bytes, extra: dict[str, bytes] | None = None) -> Path:
    """A small pure-Python wheel with its members deflated, as wheels come from the index;
    ``extra``: more members (path -> bytes), listed in its ``RECORD`` too."""
    info = f"{name}-1.0.dist-info"
    files = {
        f"{name}.py": module,
        **(extra or {}),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"]).encode()
    wheel = path / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for f, data in files.items():
            zf.writestr(f, data)
    return wheel


def test_the_wheels_travel_stored_in_one_xz_stream_and_install_as_before(
    tmp_path: Path,
) -> None:
    """``wheels.tar.xz`` holds each wheel with its members stored, not deflated (so that xz
    compresses across wheels): the same names and bytes; split over two parts and unpacked
    there in reverse order, pip installs them into the site as it did the deflated ones.
    A static library, which only a build links against, stays behind with its RECORD line."""
    cache = tmp_path / "cache"
    cache.mkdir()
    modules = {f"kvcore_probe_{i}": os.urandom(40_000).hex().encode() for i in range(2)}
    archive = {"kvcore_probe_lib/libprobe.a": b"!<arch>\n" + os.urandom(4_000)}
    wheels = [_wheel(cache, name, body, archive) for name, body in modules.items()]
    staged = tmp_path / "staged"
    staged.mkdir()
    member = vllm_bundle.wheels_member(wheels, staged)
    assert member.name == "wheels.tar.xz"
    with tarfile.open(member) as tar:
        assert tar.getnames() == [f"wheels/{w.name}" for w in wheels]
        for w in wheels:
            carried = zipfile.ZipFile(io.BytesIO(tar.extractfile(f"wheels/{w.name}").read()))  # type: ignore[union-attr]
            original = zipfile.ZipFile(w)
            kept = [n for n in original.namelist() if n not in archive]
            assert [i.filename for i in carried.infolist()] == kept
            assert {i.compress_type for i in carried.infolist()} == {zipfile.ZIP_STORED}
            record = next(n for n in kept if n.endswith("RECORD"))
            assert carried.read(record).decode().splitlines() == [f"{n},," for n in kept]
            assert all(carried.read(n) == original.read(n) for n in kept if n != record)
    out = tmp_path / "out"
    out.mkdir()
    tars = [
        out / f"part-{i}.tar"
        for i, _ in enumerate(vllm_bundle.pack_parts([member], out, 48 << 10), 1)
    ]
    assert len(tars) >= 2
    sgdev = tmp_path / "sgdev"
    env = {
        **os.environ,
        "SGDEV": str(sgdev),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    for tar in reversed(tars):
        subprocess.run(["bash", str(ROOT / "benchmarks" / "sglang_device.sh"), "unpack", str(tar)],
                       env=env, check=True, capture_output=True)  # fmt: skip
    for name, body in modules.items():
        assert (sgdev / "site" / f"{name}.py").read_bytes() == body
    assert not (sgdev / "site" / "kvcore_probe_lib").exists()
