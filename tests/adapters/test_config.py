"""``--kvcore-config`` options: parsing (engine-agnostic; the gate they ask for: test_gates.py)."""

from __future__ import annotations

import pytest

from kvcore.adapters.config import ElasticConfig
from kvcore.errors import UnsupportedConfiguration


def test_unknown_key_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedConfiguration, match="limit_gb"):
        ElasticConfig.parse({"limit_gb": 8})


@pytest.mark.parametrize("key", ["limit_bytes", "page_bytes", "reserve_max", "map_ahead"])
def test_sizes_beyond_any_device_are_refused_by_name(key: str) -> None:
    with pytest.raises(UnsupportedConfiguration, match=rf"{key} must be an integer in 0 \.\. 2"):
        ElasticConfig.parse({key: 1 << 64})


def test_deeply_nested_or_odd_backend_options_are_refused_by_name() -> None:
    with pytest.raises(UnsupportedConfiguration, match="not valid JSON"):
        ElasticConfig.parse('{"backend_options": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(UnsupportedConfiguration, match=r"backend_options\.device_bytes"):
        ElasticConfig.parse({"backend_options": {"device_bytes": {"nested": [1]}}})
    with pytest.raises(UnsupportedConfiguration, match=r"backend_options\.granularity"):
        ElasticConfig.parse({"backend_options": {"granularity": 1 << 70}})


def test_reclaim_takes_preempt_or_drain_and_refuses_others_by_name() -> None:
    assert ElasticConfig.parse(None).reclaim is None  # the engine's seam decides
    assert ElasticConfig.parse({"reclaim": "preempt"}).reclaim == "preempt"
    assert ElasticConfig.parse({"reclaim": "drain"}).reclaim == "drain"
    with pytest.raises(UnsupportedConfiguration, match='reclaim must be "preempt" or "drain"'):
        ElasticConfig.parse({"reclaim": "evict"})


def test_the_page_thread_switch_interval_is_microseconds_and_zero_leaves_it_alone() -> None:
    assert ElasticConfig.parse(None).background_switch_s == pytest.approx(50e-6)
    assert ElasticConfig.parse({"background_switch_us": 200}).background_switch_s == (
        pytest.approx(200e-6)
    )
    assert ElasticConfig.parse({"background_switch_us": 0}).background_switch_s is None
    for bad in (-1, 2.5, True, 10**6):
        with pytest.raises(UnsupportedConfiguration, match="background_switch_us must be"):
            ElasticConfig.parse({"background_switch_us": bad})
