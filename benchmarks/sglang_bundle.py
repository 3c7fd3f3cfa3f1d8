"""Pack the forked SGLang for a GPU machine with no network, in parts one call can carry.

The lent GPU machine (``docs/benchmarks.md``) has Python 3.12, torch 2.11, Triton, nvcc and
cuda-python, no SGLang and no network, and one call carries at most 64 MiB. sglang-kernel's
compiled ops cannot run on torch 2.11 (``benchmarks/sglang_compat/README.md``), so SGLang runs
there with sgl_kernel's Python files and ``sglang_compat/standin/common_ops.py`` in place of
its binary, ``--attention-backend triton --sampling-backend pytorch``, no flashinfer. This
writes ``<out>/part-N.tar`` (each at most ``--part-mib``, the default of
``benchmarks.vllm_bundle``) and ``manifest.json``; ``benchmarks/sglang_device.sh unpack``
installs a part there, one part per call, the calls back to back. What goes in:

* ``sglang-py.tar.xz``: the forked wheel's tree (patches applied, its Rust radix-tree core
  for the target Python), less ``SKIPPED``: the diffusion runtime ``sglang/multimodal_gen``
  and the Rust HTTP/gRPC servers, benchmark client and multimodal processors (a dense
  Llama/Qwen3 served over the default Python HTTP server loads none of them);
* ``sgl_kernel-py.tar.xz``: sglang-kernel's Python files and dist-info (SGLang checks its
  version through ``importlib.metadata``), no binaries: ``pack_sgl_kernel.sh --no-binary``'s
  selection;
* ``wheels.tar.xz``: target-platform wheels of SGLang's runtime requirements that the image
  lacks, resolved by pip and pinned in the manifest (``NOT_CARRIED`` and
  ``vllm_bundle.IMAGE`` left out), and ``vllm_bundle.TOOLS`` (py-spy, for the serving
  benchmark's ``--py-spy``);
* ``models.tar.xz``: the offline model directories of ``benchmarks/offline_model.py``.

    python -m benchmarks.sglang_bundle --version 0.5.23 --out .sgdev/0.5.23

Needs here: the forked wheel in ``dist/`` (``python -m patchq build sglang 0.5.23 --python
3.12``), pip, ``packaging`` and ``tokenizers``, and the registry (pip resolves, downloads the
wheels and sglang-kernel's, ~370 MB, once: ``<out>/work`` keeps them). Exits with status 2
and the command to run when a module is missing; raises ``BundleError`` when a wheel has
no member the bundle needs.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path

from benchmarks.vllm_bundle import (
    IMAGE,
    LOCAL_MODULES,
    TOOLS,
    add_bytes,
    checkout_bytes,
    default_part_mib,
    download_wheels,
    missing_modules,
    models_member,
    norm_name,
    requirements,
    resolve,
    wheel_metadata,
    wheels_member,
    write_parts,
)

ROOT = Path(__file__).resolve().parent.parent

KERNEL = "sglang-kernel"
"""The distribution whose Python files stand in for its binary (``sgl_kernel``)."""

NOT_CARRIED = re.compile(
    r"^(torch|torchaudio|torchvision|torchcodec|flashinfer-.*|sglang-kernel|nvidia-(?!ml-py$).*|"
    r"cuda-python|cuda-tile|flash-attn-4|humming-kernels|quack-kernels|"
    r"tilelang|deep-gemm|sgl-deep-ep|sgl-deep-gemm|sgl-flash-mla|nvshmem4py-cu\d+|kernels|"
    r"torch-memory-saver|deepseek-recipe|tokenspeed-mla|tokenspeed-triton|tml-renderers|av|"
    r"decord2)$"
)
"""SGLang requirements not carried: torch's family (the image's builds must be used),
sglang-kernel (its Python files travel on their own, ``KERNEL``), CUDA libraries
(``nvidia-ml-py`` travels: NVML bindings, pure Python, which SGLang imports when it sees
CUDA), kernel libraries and their loaders that a dense model on triton attention never imports
(``kernels`` is the hub kernel loader; ``torch-memory-saver`` only runs with
``--enable-memory-saver``; ``cuda-tile``, pinned by 0.5.20 to a pre-release the registry no
longer serves, only by the Kimi linear-attention prefill kernels), DeepSeek-specific recipes
and MLA kernels (0.5.20's ``tokenspeed_mla`` backend, imported only where it is installed,
and its 95 MB Triton fork) and video decoders."""

IMPORT_ONLY = {"0.5.20": ("flashinfer-python",)}
"""Per SGLang release, ``NOT_CARRIED`` distributions it imports at module level on CUDA
although the served path never calls them: their wheel alone travels, at the release's own
pin, without its requirements. 0.5.20's ``sglang/srt/layers/quantization/fp8_utils.py``
imports ``flashinfer.bmm_fp8`` under ``if _is_cuda:`` (0.5.23 guards it with
``is_flashinfer_available()``), and the memory pool imports that module, so no server
starts without flashinfer. Importing it needs only packages the image or the bundle
provides (tvm-ffi, pynvml, einops, ...); its kernel requirements (the CUTLASS DSL,
cuDNN frontend, cuda-tile, nccl4py) load only when one of its kernels is built, which
``--attention-backend triton --sampling-backend pytorch`` never asks for. A kernel asked
for anyway is flashinfer's own: its JIT builds it with the image's nvcc, or the build fails
on a requirement left behind; nothing stands in for it."""

SKIPPED = re.compile(
    r"^sglang/(multimodal_gen/|srt/rust_extensions/_(server|grpc|bench|multimodal)\.)"
)
"""Wheel members not carried: the diffusion runtime (17 MiB, ``sglang serve`` of diffusion
models only) and the Rust extensions of the Rust HTTP server (``SGLANG_RUST_SERVER``, off by
default), the native gRPC server (``--grpc-port``), the benchmark client and multimodal
processors: 41 MiB, loaded by ``load_rust_extension`` on those paths only."""


STANDINS = {
    "sglang/kernels/ops/gemm/cutedsl_dual_gemm.py": ROOT
    / "benchmarks/sglang_compat/standin/cutedsl_dual_gemm.py",
}
"""Members of the SGLang tree packed from a stand-in instead of the wheel: modules a dense
model on the GPU machine imports but cannot load there and never runs (each stand-in's
docstring says why, and what upstream does instead)."""
IMPORTERS = {
    "sglang/kernels/ops/gemm/cutedsl_dual_gemm.py": "sglang/srt/layers/dual_gemm.py",
}
"""For each ``STANDINS`` member, the module whose import of it the stand-in serves: a release
without that module (0.5.20 has no dual GEMM) needs no stand-in."""


class BundleError(RuntimeError):
    """A wheel lacks what the bundle needs from it."""


def carried(name: str) -> bool:
    """Whether the distribution ``name`` travels: neither in the image nor ``NOT_CARRIED``."""
    name = norm_name(name)
    return name not in IMAGE and not NOT_CARRIED.match(name)


def standins(names: set[str]) -> dict[str, Path]:
    """The ``STANDINS`` that apply to a wheel with members ``names``: those whose importer
    (``IMPORTERS``) it has. Raises ``BundleError`` naming a member the wheel lacks while it
    has the member's importer (a release that moved it needs its own check)."""
    needed = {m: p for m, p in STANDINS.items() if IMPORTERS[m] in names}
    absent = sorted(set(needed) - names)
    if absent:
        raise BundleError(f"no {', '.join(absent)} to stand in for")
    return needed


def wheel_standins(wheel: Path) -> dict[str, Path]:
    """``standins`` of the members of ``wheel``; its ``BundleError`` names the wheel."""
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    try:
        return standins(names)
    except BundleError as exc:
        raise BundleError(f"{wheel.name}: {exc}") from None


def sglang_tree(wheel: Path, dest: Path) -> Path:
    """``dest/sglang-py.tar.xz``: every member of the forked wheel but ``SKIPPED``, the
    members ``wheel_standins`` names from their stand-ins. Raises ``BundleError`` as it
    does."""
    tree = dest / "sglang-py.tar.xz"
    replaced = wheel_standins(wheel)
    with zipfile.ZipFile(wheel) as zf, tarfile.open(tree, "w:xz") as tar:
        for info in zf.infolist():
            if not info.is_dir() and not SKIPPED.match(info.filename):
                name = info.filename
                data = replaced[name].read_bytes() if name in replaced else zf.read(info)
                add_bytes(tar, name, data)
    return tree


def kernel_tree(wheel: Path, dest: Path) -> Path:
    """``dest/sgl_kernel-py.tar.xz``: the ``sgl_kernel`` package's ``.py`` files and the
    dist-info of an sglang-kernel wheel (``pack_sgl_kernel.sh --no-binary``'s selection).
    Raises ``BundleError`` when the wheel has neither."""
    with zipfile.ZipFile(wheel) as zf:
        names = sorted(
            n for n in zf.namelist()
            if (n.startswith("sgl_kernel/") and n.endswith(".py"))
            or re.match(r"sglang_kernel-[^/]+\.dist-info/[^/]+$", n)
        )  # fmt: skip
        if not any(n.endswith("/METADATA") for n in names) or "sgl_kernel/__init__.py" not in names:
            raise BundleError(f"{wheel.name}: no sgl_kernel/__init__.py or dist-info")
        tree = dest / "sgl_kernel-py.tar.xz"
        with tarfile.open(tree, "w:xz") as tar:
            for name in names:
                add_bytes(tar, name, zf.read(name))
    return tree


def _pin(wheel: Path, name: str) -> str:
    """The version ``wheel`` pins ``name`` to (``Requires-Dist: name==V``, any extras).
    Raises ``BundleError`` when it pins none."""
    from packaging.requirements import Requirement

    for line in wheel_metadata(wheel).splitlines():
        if line.startswith("Requires-Dist: "):
            req = Requirement(line.removeprefix("Requires-Dist: "))
            pins = [s.version for s in req.specifier if s.operator == "=="]
            if norm_name(req.name) == norm_name(name) and pins:
                return pins[0]
    raise BundleError(f"{wheel.name}: no {name}==V requirement")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", required=True, help="the forked SGLang release: 0.5.23")
    parser.add_argument("--wheel", type=Path, help="default: the newest dist/sglang-V+kvcore.*")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python")
    parser.add_argument("--part-mib", type=int, default=None, help="as in vllm_bundle")
    args = parser.parse_args(argv)
    if args.part_mib is None:
        args.part_mib = default_part_mib(checkout_bytes(ROOT))
        print(f"sglang_bundle: parts of at most {args.part_mib} MiB")
    missing = missing_modules()
    if missing:
        install = " && ".join(f"{sys.executable} -m {LOCAL_MODULES[m]}" for m in missing)
        parser.exit(2, f"sglang_bundle: no module named {', '.join(missing)}; install: {install}\n")
    tag = "cp" + args.python.replace(".", "")
    wheel = args.wheel or max(
        (ROOT / "dist").glob(f"sglang-{args.version}+kvcore.*-{tag}-*.whl"),
        key=lambda p: p.stat().st_mtime,
        default=None,
    )
    if wheel is None:
        parser.exit(2, f"sglang_bundle: no dist/sglang-{args.version}+kvcore.*-{tag}-*.whl; "
                    f"build it: python -m patchq build sglang {args.version} "
                    f"--python {args.python}\n")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "work"  # kept: a second run reuses the resolution and downloads
    work.mkdir(exist_ok=True)
    reqs = [*requirements(wheel_metadata(wheel), args.python, carried), *TOOLS]
    pins = resolve(reqs, args.python, work, carried)
    kernel_version = _pin(wheel, KERNEL)
    kernel = download_wheels([(KERNEL, kernel_version, "")], args.python, work / "kernel")[0]
    import_only = [(n, _pin(wheel, n), "") for n in IMPORT_ONLY.get(args.version, ())]
    pins = [*pins, *import_only]
    wheels = download_wheels(pins, args.python, work / "wheels")
    staged = work / "staged"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir()
    members = [wheels_member(wheels, staged), sglang_tree(wheel, staged),
               kernel_tree(kernel, staged), models_member(staged)]  # fmt: skip
    write_parts(members, args.out, args.part_mib << 20, {
        "wheel": wheel.name,
        "python": args.python,
        "sgl_kernel": f"{kernel.name}: Python files and dist-info only",
        "skipped": SKIPPED.pattern,
        "standins": {m: str(p.relative_to(ROOT)) for m, p in wheel_standins(wheel).items()},
        "import_only": [f"{n}=={v}: the wheel alone" for n, v, _ in import_only],
        "wheels": [{"name": n, "version": v, "url": u} for n, v, u in pins],
    })  # fmt: skip


if __name__ == "__main__":
    main()
