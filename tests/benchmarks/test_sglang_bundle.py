"""``benchmarks.sglang_bundle``'s pure logic (which requirements travel, which wheel members
go in, how parts are packed) and ``sglang_device.sh``'s unpack and run, on tiny stand-in
wheels: no network, nothing written outside ``tmp_path``."""

from __future__ import annotations

import io
import lzma
import os
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from benchmarks import sglang_bundle, vllm_bundle

ROOT = Path(__file__).resolve().parents[2]
DUAL_GEMM = "sglang/kernels/ops/gemm/cutedsl_dual_gemm.py"
IMPORTER = "sglang/srt/layers/dual_gemm.py"

METADATA = """\
Metadata-Version: 2.1
Name: sglang
Version: 0.5.23+kvcore.4
Requires-Dist: aiohttp
Requires-Dist: apache-tvm-ffi==0.1.11
Requires-Dist: av==16.1.0; sys_platform == "linux" and (platform_machine == "aarch64")
Requires-Dist: flashinfer_python[cu13]==0.7.2
Requires-Dist: fastapi
Requires-Dist: nvidia-cutlass-dsl[cu13]==4.8.0
Requires-Dist: sglang-kernel==0.4.10
Requires-Dist: torch==2.14.1
Requires-Dist: Torch_Memory_Saver>=0.0.9.post1
Requires-Dist: transformers==5.19.0
Requires-Dist: uvicorn>=0.51
Requires-Dist: xgrammar==0.2.7
Requires-Dist: tomli; python_version < "3.11"
Requires-Dist: granian>=2.6.0; extra == "http2"
Requires-Dist: pydantic[email]
"""


def _wheel(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def _names(tar_xz: Path) -> list[str]:
    with tarfile.open(tar_xz) as tar:
        return sorted(tar.getnames())


def test_requirements_keep_what_the_image_lacks_for_the_target_platform() -> None:
    reqs = vllm_bundle.requirements(METADATA, "3.12", sglang_bundle.carried)
    # aiohttp and transformers: in the image; av: aarch64 only; tomli: Python < 3.11;
    # granian: an extra; the rest: torch's family and GPU kernel libraries.
    assert reqs == [
        "apache-tvm-ffi==0.1.11",
        "fastapi",
        "uvicorn>=0.51",
        "xgrammar==0.2.7",
        "pydantic[email]",
    ]
    assert "tomli" in vllm_bundle.requirements(METADATA, "3.10", sglang_bundle.carried)


@pytest.mark.parametrize(
    ("name", "travels"),
    [
        ("fastapi", True),
        ("apache_tvm_ffi", True),
        ("Flashinfer-Cubin", False),
        ("nvidia-cutlass-dsl", False),
        ("nvidia-ml-py", True),  # NVML bindings, pure Python: SGLang imports pynvml
        ("sgl_deep_gemm", False),
        ("nvshmem4py-cu13", False),
        ("torch", False),
        ("numpy", False),  # the image's
        ("kernels", False),
        ("kernels-extra", True),  # whole names only
        ("cuda-tile", False),  # 0.5.20 pins a pre-release the registry no longer has
        ("tokenspeed_mla", False),  # an MLA backend, imported only where installed
    ],
)
def test_carried(name: str, travels: bool) -> None:
    assert sglang_bundle.carried(name) is travels


def test_picked_pins_the_carried_part_of_a_pip_report() -> None:
    def item(name: str, version: str) -> dict:
        return {"metadata": {"name": name, "version": version},
                "download_info": {"url": f"https://x/{name}-{version}.whl"}}  # fmt: skip

    report = {"install": [item("Uvicorn", "0.52.0"), item("torch", "2.14.1"),
                          item("numpy", "2.3.0"), item("apache_tvm_ffi", "0.1.11")]}  # fmt: skip
    assert vllm_bundle.picked(report, sglang_bundle.carried) == [
        ("apache-tvm-ffi", "0.1.11", "https://x/apache_tvm_ffi-0.1.11.whl"),
        ("uvicorn", "0.52.0", "https://x/Uvicorn-0.52.0.whl"),
    ]


def test_the_sglang_tree_leaves_out_the_skipped_members(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "sglang.whl", {
        "sglang/__init__.py": b"",
        "sglang/srt/rust_extensions/loader.py": b"",
        "sglang/srt/rust_extensions/_server.cpython-312-x86_64-linux-gnu.so": b"x",
        "sglang/srt/rust_extensions/_grpc.cpython-312-x86_64-linux-gnu.so": b"x",
        "sglang/srt/mem_cache/rust_tree_core/mem_cache.cpython-312-x86_64-linux-gnu.so": b"x",
        "sglang/multimodal_gen/runtime/server.py": b"",
        "sglang/multimodal/keep.py": b"",
        DUAL_GEMM: b"import cutlass\n",
        IMPORTER: b"",
        "sglang-0.5.23+kvcore.4.dist-info/METADATA": METADATA.encode(),
    })  # fmt: skip
    tree = sglang_bundle.sglang_tree(wheel, tmp_path)
    assert _names(tree) == [
        "sglang-0.5.23+kvcore.4.dist-info/METADATA",
        "sglang/__init__.py",
        DUAL_GEMM,
        "sglang/multimodal/keep.py",
        IMPORTER,
        "sglang/srt/mem_cache/rust_tree_core/mem_cache.cpython-312-x86_64-linux-gnu.so",
        "sglang/srt/rust_extensions/loader.py",
    ]
    with tarfile.open(tree) as tar:
        packed = tar.extractfile(DUAL_GEMM).read()  # type: ignore[union-attr]
    assert packed == sglang_bundle.STANDINS[DUAL_GEMM].read_bytes()


def test_a_wheel_without_a_member_a_standin_replaces_is_refused(tmp_path: Path) -> None:
    """The module that imports the member is there, the member is not: a release that moved
    it needs its own check."""
    wheel = _wheel(tmp_path / "sglang.whl", {"sglang/__init__.py": b"", IMPORTER: b""})
    with pytest.raises(sglang_bundle.BundleError, match=r"cutedsl_dual_gemm\.py to stand in for"):
        sglang_bundle.sglang_tree(wheel, tmp_path)


def test_a_release_without_the_importer_packs_without_the_standin(tmp_path: Path) -> None:
    """SGLang 0.5.20 has no dual GEMM: nothing to stand in for, its tree goes as it is."""
    wheel = _wheel(tmp_path / "sglang.whl", {"sglang/__init__.py": b"x = 1\n"})
    tree = sglang_bundle.sglang_tree(wheel, tmp_path)
    assert _names(tree) == ["sglang/__init__.py"]
    assert sglang_bundle.standins({"sglang/__init__.py"}) == {}


def test_the_dual_gemm_standin_answers_as_upstream_before_blackwell(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What ``DualGemm`` reads: upstream's names and values, ``False`` without SM100 (the
    stand-in asks SGLang's own ``is_sm100_supported``, stood in for here: SGLang is not
    installed in this session), a refusal with it."""
    import importlib.util
    import sys
    import types

    spec = importlib.util.spec_from_file_location(
        "standin_dual_gemm", sglang_bundle.STANDINS[DUAL_GEMM]
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.MAX_DUAL_GEMM_DECODE_TOKENS == 16
    assert [(m.name, m.value) for m in mod.DualGemmQuantMode] == [
        ("STATIC_PER_TENSOR", 0), ("STATIC_PER_TOKEN", 1), ("DYNAMIC_PER_TENSOR", 2),
        ("DYNAMIC_PER_TOKEN", 3), ("UNQUANT", 4),
    ]  # fmt: skip
    sm100 = [False]
    utils = types.ModuleType("sglang.srt.utils")
    utils.is_sm100_supported = lambda: sm100[0]  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.utils", utils)
    assert mod.can_use_dual_gemm(16, 4096, 14336, mod.DualGemmQuantMode.UNQUANT) is False
    sm100[0] = True
    with pytest.raises(RuntimeError, match="before Blackwell"):
        mod.can_use_dual_gemm(16, 4096, 14336, mod.DualGemmQuantMode.UNQUANT)


def test_the_kernel_tree_takes_python_files_and_dist_info_only(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "sk.whl", {
        "sgl_kernel/__init__.py": b"",
        "sgl_kernel/load_utils.py": b"",
        "sgl_kernel/testing/helpers.py": b"",
        "sgl_kernel/sm90/common_ops.abi3.so": b"x",
        "sgl_kernel/flash_ops.abi3.so": b"x",
        "sglang_kernel-0.4.10.dist-info/METADATA": b"Name: sglang-kernel\nVersion: 0.4.10\n",
        "sglang_kernel-0.4.10.dist-info/RECORD": b"",
    })  # fmt: skip
    assert _names(sglang_bundle.kernel_tree(wheel, tmp_path)) == [
        "sgl_kernel/__init__.py",
        "sgl_kernel/load_utils.py",
        "sgl_kernel/testing/helpers.py",
        "sglang_kernel-0.4.10.dist-info/METADATA",
        "sglang_kernel-0.4.10.dist-info/RECORD",
    ]
    empty = _wheel(tmp_path / "empty.whl", {"sgl_kernel/__init__.py": b""})
    with pytest.raises(sglang_bundle.BundleError, match="dist-info"):
        sglang_bundle.kernel_tree(empty, tmp_path / "x")


def test_pins_are_read_from_the_wheel(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path / "s.whl", {"sglang-0.5.23.dist-info/METADATA": METADATA.encode()})
    assert sglang_bundle._pin(wheel, sglang_bundle.KERNEL) == "0.4.10"
    assert sglang_bundle._pin(wheel, "flashinfer-python") == "0.7.2"  # written with _, extras
    bare = _wheel(tmp_path / "b.whl", {"sglang-0.5.23.dist-info/METADATA": b"Name: sglang\n"})
    with pytest.raises(sglang_bundle.BundleError, match="sglang-kernel==V"):
        sglang_bundle._pin(bare, sglang_bundle.KERNEL)


def test_import_only_distributions_are_otherwise_not_carried() -> None:
    # resolved like the others, they would bring their kernel requirements along
    for names in sglang_bundle.IMPORT_ONLY.values():
        assert names and not any(sglang_bundle.carried(n) for n in names)


def _xz_tar(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:xz") as tar:
        for name, data in files.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return path


def test_parts_unpack_and_run_on_the_device_whatever_their_order(tmp_path: Path) -> None:
    staged = tmp_path / "staged"
    staged.mkdir()
    payload = os.urandom(200_000)  # incompressible: the tree goes in pieces
    tree = _xz_tar(staged / "sglang-py.tar.xz", {"sglang/blob.bin": payload})
    kernel = _xz_tar(staged / "sgl_kernel-py.tar.xz", {"sgl_kernel/__init__.py": b"X = 1\n"})
    models = _xz_tar(staged / "models.tar.xz", {"models/qwen3-0.6b/config.json": b"{}"})
    out = tmp_path / "out"
    out.mkdir()
    limit = 96 << 10
    parts = vllm_bundle.pack_parts([tree, kernel, models], out, limit)
    assert len(parts) >= 3 and lzma.decompress(tree.read_bytes())  # still whole here
    tars = sorted(out.glob("part-*.tar"))
    assert all(t.stat().st_size <= limit for t in tars)
    sgdev = tmp_path / "sgdev"
    env = {**os.environ, "SGDEV": str(sgdev)}
    script = str(ROOT / "benchmarks" / "sglang_device.sh")
    for tar in reversed(tars):
        subprocess.run(["bash", script, "unpack", str(tar)], env=env, check=True,
                       capture_output=True)  # fmt: skip
    assert (sgdev / "site" / "sglang" / "blob.bin").read_bytes() == payload
    assert (sgdev / "site" / "sgl_kernel" / "__init__.py").exists()
    assert list((sgdev / "pieces").iterdir()) == []
    code = (
        "import os, sys, sgl_kernel; print(os.environ['KVCORE_MODEL_DIR']); "
        "print(os.environ['SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND']); print(sys.path)"
    )
    env.pop("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", None)
    run = subprocess.run(["bash", script, "run", "python3", "-c", code], env=env, check=True,
                         capture_output=True, text=True)  # fmt: skip
    model_dir, tree_core, path = run.stdout.splitlines()
    assert model_dir == str(sgdev / "models" / "qwen3-0.6b")
    assert tree_core == "python"  # the Rust core's binary cannot read the image's tensors
    assert str(ROOT / "benchmarks" / "sglang_compat" / "standin") in path
