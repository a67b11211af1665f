"""``python -m qcollect.bench device --quick``: the codecs, the copy bandwidth
and the language model's step on this machine's device (CPU here)."""

import json
import math

import jax
import pytest

from qcollect.bench import device
from qcollect.bench.__main__ import BENCHMARKS
from qcollect.bench.__main__ import main as bench_main
from qcollect.bench.quantizers import COMPRESSORS

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("device")
    assert bench_main(["device", "--quick", "--out", str(out)]) == 0
    folder = out / jax.default_backend()
    return json.loads((folder / "device.json").read_text()), folder


def _positive(value):
    return math.isfinite(value) and value > 0


def test_registered():
    assert BENCHMARKS["device"] == "qcollect.bench.device"


def test_copy_bandwidth_is_measured(written):
    result, _ = written
    assert result["platform"] == jax.default_backend()
    assert _positive(result["copy_gbs"])
    assert result["copy_gbs"] == result["bandwidth_gbs"]["copy"]
    assert result["shape"] == [256, 256]


def test_a_row_per_compressor_with_rates_and_fractions_of_copy(written):
    result, _ = written
    rows = {r["compressor"]: r for r in result["compressors"]}
    assert list(rows) == list(COMPRESSORS)
    values = 256 * 256
    for r in rows.values():
        assert r["round_trip_bytes"] == 8 * values
        for part in ("encode", "decode", "round_trip"):
            assert _positive(r[f"{part}_ms"]) and _positive(r[f"{part}_gbs"])
            assert _positive(r[f"{part}_of_copy"])
            assert r[f"{part}_of_copy"] == pytest.approx(r[f"{part}_gbs"] / result["copy_gbs"])
    # The bytes a codec must move: the float32 input and the payload.
    assert rows["identity"]["encode_bytes"] == 8 * values
    assert rows["onebit (bucket 64)"]["encode_bytes"] < 5 * values


def test_language_model_rows_against_none(written):
    result, _ = written
    lm = result["lm"]
    names = [r["all_reduce"] for r in lm["rows"]]
    assert names == list(device.QUICK_LM)
    for r in lm["rows"]:
        assert _positive(r["step_ms"]) and _positive(r["overhead_vs_none"])
    assert lm["rows"][0]["overhead_vs_none"] == 1.0


def test_markdown_and_single_device_network_note(written):
    result, folder = written
    text = (folder / "device.md").read_text()
    for part in ("copy **", "| qsgd-4 (bucket 512) |", "| none |", "## All-reduce"):
        assert part in text
    assert result["network"]["rows"] == [] and result["network"]["skipped"]


def test_network_rows_over_several_devices():
    rows = device.network_rows(0.0625, repeats=1, calls=1, methods=["qsgd-4"])
    assert [r["method"] for r in rows] == ["psum", "qsgd-4"]
    assert rows[0]["speedup_vs_psum"] == 1.0 and rows[0]["devices"] == jax.device_count()
    assert rows[1]["wire_bytes"] < rows[0]["wire_bytes"]
    assert all(_positive(r["median_ms"]) for r in rows)


def test_lm_names_are_one_compressor_all_reduces():
    device._examples()
    names = device.lm_names()
    assert names[0] == "none" and "qsgd-4" in names
    assert not set(names) & set(device.OTHER_TRANSFORMS)
