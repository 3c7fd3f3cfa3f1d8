"""``benchmarks/vmm_release.py`` runs its whole release path on the host backend: every
variant gives back every handle, counted call by call."""

from __future__ import annotations

from benchmarks import vmm_release


def test_release_breakdown_on_the_host_backend(tmp_path):
    out_path = tmp_path / "release.json"
    args = vmm_release.parse_args(
        [
            "--backend",
            "host",
            "--gib",
            "0.125",
            "--page-mib",
            "2",
            "--ranges",
            "8",
            "--repeats",
            "1",
            "--json",
            str(out_path),
        ]
    )
    out = vmm_release.run(args)
    (row,) = out["results"]
    assert row["handles"] == 64 and row["ranges"] == 8
    per_handle, per_run, kv = row["raw_per_handle"], row["raw_per_run"], row["kvcore"]
    # one driver call per handle and kind, except the spanning calls of the per-run path
    assert {k: per_handle[k]["calls"] for k in vmm_release.PHASES} == {
        "synchronize": 1,
        "unmap": 64,
        "map_zero": 64,
        "set_access_ro": 64,
        "release": 64,
    }
    assert row["raw_per_run_error"] is None
    assert per_run["unmap"]["calls"] == 8 and per_run["set_access_ro"]["calls"] == 8
    assert per_run["map_zero"]["calls"] == 64 and per_run["release"]["calls"] == 64
    # kvcore's mapper makes the same calls as the raw per-handle sequence
    assert {k: kv[k]["calls"] for k in vmm_release.PHASES} == {
        k: per_handle[k]["calls"] for k in vmm_release.PHASES
    }
    alloc = row["allocator"]
    assert 0 <= alloc["first_ms"] <= alloc["all_ms"] and alloc["gate_releases"] >= 1
