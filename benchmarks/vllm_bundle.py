"""Pack a forked vLLM wheel for a GPU machine with no network, in parts one call can carry.

The lent GPU machine (``docs/benchmarks.md``, "vLLM on the GPU machine") has Python 3.12,
torch, Triton and the CUDA toolkit, no vLLM and no network, and one call carries at most
64 MiB. vLLM's compiled kernels use torch's stable C ABI, so the release's own ``.so``
files load on the image's torch. This writes ``<out>/part-N.tar`` (each at most
``--part-mib``) and ``manifest.json``; ``benchmarks/vllm_device.sh unpack`` installs a
part there, one part per call, the calls back to back (the machine keeps ``/tmp`` while it
stays warm). What goes in:

* the forked wheel's Python tree (patches applied), with its small extension modules; the
  large ones that serving a dense model on Hopper loads (``_C_stable_libtorch``, FA3's
  ``_vllm_fa3_C``) each xz-compressed on its own; left out: FA2, MoE, DeepGEMM, FMHA-SM100,
  FlashMLA and the Rust frontend binary (not loaded for dense attention models on an H200;
  ``third_party``'s Python modules, pynvml among them, stay: platform detection needs it);
* cp312 manylinux wheels of vLLM's runtime requirements the image lacks, resolved by pip
  for the target platform and pinned in the manifest (GPU kernel libraries vLLM lists but a
  dense model on FA3 never imports, and everything the image has, left out);
* ``TOOLS``: the profiler ``python3 -m benchmarks.vllm_serve --py-spy`` runs there;
* the offline model directories of ``benchmarks/offline_model.py``.

    python -m benchmarks.vllm_bundle --version 0.33.0 --out .vdev/0.33.0

Needs ``tokenizers`` here (the model directories), pip and the registry (pip download);
``LOCAL_MODULES`` are checked before any work starts.
"""

from __future__ import annotations

import argparse
import io
import json
import lzma
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from benchmarks.offline_model import SHAPES, write_model_dir

ROOT = Path(__file__).resolve().parent.parent

IMAGE = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
numpy numpyro onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()  # noqa: SIM905
"""What the GPU machine's image provides (the device tool's KINDS.md, read 2026-11-17)."""

NOT_CARRIED = re.compile(
    r"^(torch|torchaudio|torchvision|torchcodec|pynvvideocodec|flashinfer-python|tilelang|"
    r"nvidia-.*|nvtx|fastsafetensors|instanttensor|quack-kernels|tokenspeed-mla|"
    r"humming-kernels|numba|opencv-python-headless|ninja|opentelemetry-(sdk|exporter-otlp)|"
    r"opentelemetry-semantic-conventions-ai)$"
)
"""vLLM requirements not carried: CUDA builds of torch and kernel libraries a dense model on
FA3 never imports, what the image has in its own build, tracing exporters (off by default)."""

BIG_SO = ("vllm/_C_stable_libtorch.abi3.so", "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so")
"""Compiled modules carried, each xz-compressed on its own (too large for a shared part)."""

SKIPPED = re.compile(
    r"^vllm/(vllm-rs|third_party/(deep_gemm|fmha_sm100)/|vllm_flash_attn/_vllm_fa2_C|_moe_C|"
    r"_flashmla|_deepselect_C|"
    r"_flashkda_C|_qutlass_C)"
)
"""Wheel members not carried (not loaded serving a dense model with FA3 on an H200)."""

TOOLS = ("py-spy==0.4.1",)
"""Carried beside vLLM's requirements: what the benchmarks run on the GPU machine."""

LOCAL_MODULES = {
    "pip": "ensurepip --upgrade",
    "packaging": "pip install packaging",
    "tokenizers": "pip install tokenizers",
}
"""The modules beside the standard library this script needs here, each with the
``python -m`` arguments that install it: pip resolves and downloads the wheels,
``packaging`` reads the requirements' markers, ``tokenizers`` builds the model directories
(the last step, minutes in)."""

PLATFORMS = ("manylinux_2_34", "manylinux_2_31", "manylinux_2_28", "manylinux_2_27",
             "manylinux_2_26", "manylinux_2_24", "manylinux_2_17", "manylinux2014",
             "manylinux1")  # fmt: skip


def norm_name(name: str) -> str:
    """A distribution name in PEP 503's normalized form (``Foo_Bar.baz`` -> ``foo-bar-baz``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _carried(name: str) -> bool:
    """Whether the distribution ``name`` travels: neither in the image nor ``NOT_CARRIED``."""
    name = norm_name(name)
    return name not in IMAGE and not NOT_CARRIED.match(name)


def pip_target_args(python: str) -> list[str]:
    """pip options that resolve and download binary wheels for the GPU machine: CPython
    ``python`` on the manylinux ``PLATFORMS`` of x86-64."""
    args = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    for p in PLATFORMS:
        args += ["--platform", f"{p}_x86_64"]
    return args


def target_environment(python: str) -> dict[str, str]:
    """Marker variables of the GPU machine: CPython ``python`` on x86-64 Linux, no extra."""
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "extra": "",
    }


def wheel_metadata(wheel: Path) -> str:
    """The text of a wheel's ``.dist-info/METADATA``. Raises ``ValueError`` without one."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        if not names:
            raise ValueError(f"{wheel.name}: no .dist-info/METADATA")
        return zf.read(names[0]).decode()


def requirements(
    metadata: str, python: str, carried: Callable[[str], bool] = _carried
) -> list[str]:
    """The runtime requirements in a wheel's ``METADATA`` text that apply on the GPU machine
    (markers evaluated for ``target_environment``, so no extras) and travel (``carried``),
    markers dropped."""
    from packaging.requirements import Requirement

    env = target_environment(python)
    reqs = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = Requirement(line.removeprefix("Requires-Dist: "))
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        if carried(req.name):
            extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
            reqs.append(f"{req.name}{extras}{req.specifier}")
    return reqs


def resolve(
    reqs: list[str], python: str, work: Path, carried: Callable[[str], bool] = _carried
) -> list[tuple[str, str, str]]:
    """``(name, version, url)`` of every wheel to carry: pip's resolution of ``reqs`` for the
    target platform, less what does not travel (``carried``); reused from ``work`` while
    ``reqs`` are unchanged."""
    req_file = work / "requirements.txt"
    req_file.write_text("\n".join(reqs) + "\n")
    report, used = work / "report.json", work / "requirements.used"
    if report.exists() and used.exists() and used.read_text() == req_file.read_text():
        print("reusing the last resolution (delete work/report.json to resolve again)")
        return picked(json.loads(report.read_text()), carried)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
           *pip_target_args(python), "--target", str(work / "target"),
           "--report", str(report), "-r", str(req_file)]  # fmt: skip
    print("resolving the requirements for the GPU machine (pip, minutes) ...", flush=True)
    subprocess.run(cmd, check=True)
    shutil.copy(req_file, used)
    return picked(json.loads(report.read_text()), carried)


def picked(
    report: dict[str, Any], carried: Callable[[str], bool] = _carried
) -> list[tuple[str, str, str]]:
    """``(name, version, url)`` of each carried distribution of a ``pip install --report``."""
    out = []
    for item in report["install"]:
        name = norm_name(item["metadata"]["name"])
        if carried(name):
            out.append((name, item["metadata"]["version"], item["download_info"]["url"]))
    return sorted(out)


def download_wheels(picked: list[tuple[str, str, str]], python: str, dest: Path) -> list[Path]:
    """The wheel of every ``picked`` pin, downloading what ``dest`` lacks. ``dest`` is a cache
    kept between runs, so it may hold wheels of an earlier resolution: only the pinned ones
    are returned (two versions of one package in a bundle make pip refuse the install)."""
    dest.mkdir(parents=True, exist_ok=True)

    def cached() -> dict[str, Path]:
        return {norm_name(w.name.split("-")[0]) + "==" + w.name.split("-")[1]: w
                for w in dest.glob("*.whl")}  # fmt: skip

    wanted = [f"{n}=={v}" for n, v, _ in picked]
    specs = [spec for spec in wanted if spec not in cached()]
    if specs:
        print(f"downloading {len(specs)} wheels ...", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
               *pip_target_args(python), "-d", str(dest), *specs]  # fmt: skip
        subprocess.run(cmd, check=True)
    have = cached()
    missing = [spec for spec in wanted if spec not in have]
    if missing:
        raise SystemExit(f"pip downloaded no wheel for {', '.join(missing)}")
    return sorted(have[spec] for spec in wanted)


def missing_modules() -> list[str]:
    """The ``LOCAL_MODULES`` this Python cannot import (looked up, not imported)."""
    return [name for name in LOCAL_MODULES if find_spec(name) is None]


def _xz(data: bytes) -> bytes:
    return lzma.compress(data, preset=6)


def _python_tree(wheel: Path, dest: Path, cache: Path) -> tuple[Path, list[Path]]:
    """``vllm-py.tar.xz`` (everything not large or skipped) and one ``.xz`` per big module."""
    bigs: list[Path] = []
    tree = dest / "vllm-py.tar.xz"
    with zipfile.ZipFile(wheel) as zf, tarfile.open(tree, "w:xz") as tar:
        for info in zf.infolist():
            name = info.filename
            if info.is_dir() or SKIPPED.match(name):
                continue
            if name in BIG_SO:
                out = dest / (name.replace("/", "%") + ".xz")  # the path, in one file name
                cached = cache / f"{info.CRC:08x}-{out.name}"
                if not cached.exists():  # read and compress only what the cache lacks
                    print(f"compressing {name} ({info.file_size >> 20} MiB) ...", flush=True)
                    cache.mkdir(exist_ok=True)
                    cached.write_bytes(_xz(zf.read(info)))
                shutil.copy(cached, out)
                bigs.append(out)
                continue
            add_bytes(tar, name, zf.read(info))
    return tree, bigs


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """Write ``data`` into the open ``tar`` as the regular file ``name``: executable when it
    is a shared object (``.so``), as a wheel installs it, else read-write."""
    member = tarfile.TarInfo(name)
    member.size, member.mode = len(data), 0o755 if name.endswith(".so") else 0o644
    tar.addfile(member, io.BytesIO(data))


def models_member(dest: Path) -> Path:
    """``dest/models.tar.xz``: the offline model directory of every ``SHAPES`` entry, under
    ``models/`` (``benchmarks/offline_model.py``); its path."""
    out = dest / "models.tar.xz"
    with tempfile.TemporaryDirectory() as tmp:
        for shape in SHAPES:
            write_model_dir(Path(tmp), shape)
        with tarfile.open(out, "w:xz") as tar:
            tar.add(tmp, arcname="models")
    return out


_TAR_MEMBER = 4096
"""Bytes a tar member may take beyond its data (header and padding), at most."""
_TAR_END = tarfile.RECORDSIZE
"""Bytes a tar file may take beyond its members (end blocks, padded to a record)."""


def split_member(f: Path, limit: int) -> list[Path]:
    """``f`` itself when it fits a part of ``limit`` bytes, else its pieces beside it, each
    fitting one, named ``<name>.<k>-of-<n>`` (k from 1): ``vllm_device.sh unpack`` joins
    them once all have arrived, in any order of parts."""
    size, room = f.stat().st_size, limit - _TAR_END - _TAR_MEMBER
    if size <= room:
        return [f]
    n = -(-size // room)
    pieces = []
    with f.open("rb") as src:
        for k in range(1, n + 1):
            piece = f.with_name(f"{f.name}.{k}-of-{n}")
            piece.write_bytes(src.read(room))
            pieces.append(piece)
    return pieces


CALL_MIB = 64
"""What one device call carries: the checkout and the part together."""
CHECKOUT_MARGIN_MIB = 2
"""Left for the checkout to grow (results, docs) between building a bundle and using it."""


def checkout_bytes(root: Path) -> int:
    """Bytes of what a device call carries from the checkout at ``root``: tracked files and
    untracked ones git does not ignore."""
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
    ).stdout
    paths = (root / name for name in listed.decode().split("\0") if name)
    return sum(p.stat().st_size for p in paths if p.is_file())


def default_part_mib(checkout: int) -> int:
    """The largest part a call can carry beside a checkout of ``checkout`` bytes, less
    ``CHECKOUT_MARGIN_MIB``."""
    return CALL_MIB - -(-checkout // (1 << 20)) - CHECKOUT_MARGIN_MIB


def pack_parts(files: list[Path], out: Path, limit: int) -> list[list[Path]]:
    """First-fit-decreasing into parts of at most ``limit`` bytes each (a larger file goes
    in pieces, ``split_member``)."""
    parts: list[list[Path]] = []
    sizes: list[int] = []
    pieces = [piece for f in files for piece in split_member(f, limit)]
    for f in sorted(pieces, key=lambda p: p.stat().st_size, reverse=True):
        size = f.stat().st_size + _TAR_MEMBER
        for i, used in enumerate(sizes):
            if used + size <= limit:
                parts[i].append(f)
                sizes[i] += size
                break
        else:
            parts.append([f])
            sizes.append(_TAR_END + size)
    for i, members in enumerate(parts, 1):
        with tarfile.open(out / f"part-{i}.tar", "w") as tar:
            for f in members:
                tar.add(f, arcname=f.name)
    return parts


def wheels_member(wheels: list[Path], dest: Path) -> Path:
    """``dest/wheels.tar.xz``: ``wheels`` under ``wheels/``, each rewritten with its members
    stored instead of deflated and without static libraries (``_stored_wheel``: a wheel pip
    installs as before), so that one xz stream compresses across all of them, which deflated
    members do not allow; the device script installs them with pip, no index, no
    dependencies. Returns its path. Prints a line first: xz's highest preset takes minutes on
    a small machine."""
    out = dest / "wheels.tar.xz"
    print(f"wheels.tar.xz: {len(wheels)} wheels, stored and compressed with xz -9", flush=True)
    with tarfile.open(out, "w:xz", preset=9) as tar:
        for w in wheels:
            add_bytes(tar, f"wheels/{w.name}", _stored_wheel(w))
    return out


def _stored_wheel(wheel: Path) -> bytes:
    """``wheel``'s bytes with every member stored (``ZIP_STORED``), in the same order with the
    same names, dates and permission bits, except static libraries (``*.a``) and their
    ``RECORD`` lines: only a build links against them, never an import (xgrammar 0.2.1 ships
    a 65 MB ``libxgrammar.a`` beside the bindings it loads)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            if _static_library(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(x for x in lines if not _static_library(x.split(",")[0])).encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_STORED)
    return buf.getvalue()


def _static_library(member: str) -> bool:
    return member.endswith(".a")


def write_parts(
    members: list[Path], out: Path, limit: int, manifest: dict[str, object]
) -> dict[str, object]:
    """``members`` packed into ``out/part-N.tar`` (``pack_parts``, at most ``limit`` bytes
    each, parts of an earlier run removed first), and ``out/manifest.json``: ``manifest``
    plus ``parts`` (part name -> member names) and the model ``shapes``. Prints each part's
    size; returns the manifest written."""
    for old in out.glob("part-*.tar"):
        old.unlink()
    parts = pack_parts(members, out, limit)
    manifest = {
        **manifest,
        "parts": {f"part-{i}.tar": [p.name for p in ps] for i, ps in enumerate(parts, 1)},
        "shapes": sorted(SHAPES),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    for i, ps in enumerate(parts, 1):
        size = (out / f"part-{i}.tar").stat().st_size
        print(f"{out / f'part-{i}.tar'}: {size / 2**20:.1f} MiB: {', '.join(p.name for p in ps)}")
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", required=True, help="the forked vLLM release, e.g. 0.33.0")
    parser.add_argument("--wheel", type=Path, help="default: the newest dist/vllm-V+kvcore.*")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python")
    parser.add_argument(
        "--part-mib",
        type=int,
        default=None,
        help=f"part size limit (default: {CALL_MIB} MiB a call carries, less this checkout "
        f"and {CHECKOUT_MARGIN_MIB} MiB for it to grow); a larger file goes in pieces",
    )
    args = parser.parse_args(argv)
    if args.part_mib is None:
        args.part_mib = default_part_mib(checkout_bytes(Path(__file__).resolve().parents[1]))
        print(f"vllm_bundle: parts of at most {args.part_mib} MiB")
    missing = missing_modules()
    if missing:  # before the resolution and the downloads, not after them
        install = " && ".join(f"{sys.executable} -m {LOCAL_MODULES[m]}" for m in missing)
        parser.exit(2, f"vllm_bundle: no module named {', '.join(missing)}; install: {install}\n")
    wheel = args.wheel or max(
        (ROOT / "dist").glob(f"vllm-{args.version}+kvcore.*.whl"), key=lambda p: p.stat().st_mtime
    )
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work"  # kept: a second run reuses the resolution and downloads
    work.mkdir(exist_ok=True)
    pins = resolve([*requirements(wheel_metadata(wheel), args.python), *TOOLS], args.python, work)
    wheels = download_wheels(pins, args.python, work / "wheels")
    staged = work / "staged"
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir()
    deps = wheels_member(wheels, staged)
    tree, bigs = _python_tree(wheel, staged, work / "xz")
    models = models_member(staged)
    listed = [{"name": n, "version": v, "url": u} for n, v, u in pins]
    write_parts([deps, tree, models, *bigs], args.out, args.part_mib << 20,
                {"wheel": wheel.name, "python": args.python, "wheels": listed})  # fmt: skip


if __name__ == "__main__":
    main()
