"""``python -m qcollect.bench device --quick``: the codecs, the copy bandwidth
and the language model's step on this machine's device (CPU here)."""

import json
import math

import jax
import jax.numpy as jnp
import pytest

from qcollect.bench import _device_lm, _device_report, _profile, device, device_timing
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
    # The targets' compressors first, the time budget's last rows least needed.
    targeted = list(_device_report.ROUND_TRIP_TARGETS)
    assert list(rows) == targeted + [n for n in COMPRESSORS if n not in targeted]
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
    # What the compiled round trip moves: at least the input and the residual.
    for name in ("onebit (bucket 64)", "qsgd-4 (bucket 512)"):
        r = rows[name]
        assert r["round_trip_kernels"] >= 1
        assert r["round_trip_compiled_bytes"] >= r["round_trip_bytes"]
        assert r["round_trip_compiled_of_copy"] == pytest.approx(
            r["round_trip_of_copy"] * r["round_trip_compiled_bytes"] / r["round_trip_bytes"])


def test_targets_on_a_synthetic_result():
    """Each target against figures worked out by hand: a round trip at or
    above half the copy bandwidth meets it, a step at or below 1.10 times
    none's meets it, the references (none, local) are no target, and a
    compressor not measured is said so."""
    rows = [{"all_reduce": "none", "overhead_vs_none": 1.0},
            {"all_reduce": "local", "overhead_vs_none": 0.8},
            {"all_reduce": "qsgd-4", "overhead_vs_none": 1.10},
            {"all_reduce": "onebit", "overhead_vs_none": 1.25}]
    r = {"compressors": [{"compressor": "identity", "round_trip_of_copy": 0.9},
                         {"compressor": "qsgd-4 (bucket 512)", "round_trip_of_copy": 0.5},
                         {"compressor": "onebit (bucket 64)", "round_trip_of_copy": 0.25}],
         "lm": {"rows": rows}}
    assert _device_report.targets(r) == [
        {"target": "onebit (bucket 64) round trip >= 0.5 of copy", "value": 0.25, "met": False},
        {"target": "qsgd-4 (bucket 512) round trip >= 0.5 of copy", "value": 0.5, "met": True},
        {"target": "qsgd-4 step <= 1.10 x none", "value": 1.10, "met": True},
        {"target": "onebit step <= 1.10 x none", "value": 1.25, "met": False}]
    skipped = {"compressors": [{"compressor": "onebit (bucket 64)", "skipped": "budget"}],
               "lm": {"rows": [], "skipped": "no examples folder"}}
    assert _device_report.targets(skipped) == [
        {"target": "onebit (bucket 64) round trip >= 0.5 of copy", "value": None, "met": None},
        {"target": "qsgd-4 (bucket 512) round trip >= 0.5 of copy", "value": None, "met": None}]


def test_targets_and_a_profile_for_each_miss(written):
    result, folder = written
    assert result["complete"] is True
    # The targets read the rows' own figures: each round trip's fraction of the
    # copy bandwidth against 0.5, qsgd-4's step over none's against 1.10.
    codecs = {c["compressor"]: c["round_trip_of_copy"] for c in result["compressors"]}
    step = {r["all_reduce"]: r["overhead_vs_none"] for r in result["lm"]["rows"]}["qsgd-4"]
    values = [codecs["onebit (bucket 64)"], codecs["qsgd-4 (bucket 512)"], step]
    assert [t["value"] for t in result["targets"]] == values
    assert [t["met"] for t in result["targets"]] == [
        values[0] >= 0.5, values[1] >= 0.5, step <= 1.10]
    names = [t["target"] for t in result["targets"]]
    assert names == [f"{c} round trip >= 0.5 of copy" for c in _device_report.ROUND_TRIP_TARGETS
                     ] + ["qsgd-4 step <= 1.10 x none"]
    missed_codecs = [t for t in result["targets"][:2] if not t["met"]]
    for t in missed_codecs:
        profile = result["profiles"][f"the {t['target'].split(' round trip')[0]} round trip"]
        assert 1 <= len(profile["top"]) <= 4 and profile["total_ms"] > 0
        assert all(ms >= 0 for _, ms in profile["top"])
    step_missed = not result["targets"][2]["met"]
    assert ("the step with qsgd-4" in result["profiles"]) == step_missed
    assert ("the step with none" in result["profiles"]) == step_missed
    assert "## Targets" in (folder / "device.md").read_text()


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
    """The example program's ``--list``: none, local, the targets' two first;
    no name that runs another transform, plan or phases."""
    names = _device_lm.lm_names()
    assert names[:4] == ["none", "local", "qsgd-4", "onebit"]
    assert not set(names) & {"entropy", "powersgd", "gradiveq"}


def test_without_an_examples_folder_the_model_part_is_skipped(monkeypatch, tmp_path):
    monkeypatch.setenv("QCOLLECT_EXAMPLES", str(tmp_path))  # a folder without the programs
    assert _device_lm.lm_names() == []
    part = _device_lm.lm_part({"width": 32}, ["none"], device_timing.Clock(60.0), lambda line: None,
                              repeats=1, calls=1, profile_top=0)
    assert part["rows"] == [] and part["setting"] == {"width": 32}
    assert part["skipped"].startswith("no examples folder: ")
    assert "Skipped: no examples folder" in _device_report._lm_table(part)[0]


def test_a_spent_budget_skips_the_rest_and_says_so(tmp_path):
    assert device.main(["--quick", "--budget", "1e-9", "--out", str(tmp_path)]) == 0
    folder = tmp_path / jax.default_backend()
    result = json.loads((folder / "device.json").read_text())
    assert result["complete"] is True and result["copy_gbs"] > 0
    assert all("--budget" in r["skipped"] for r in result["compressors"])
    assert "--budget" in result["lm"]["skipped"]
    assert [t["met"] for t in result["targets"]] == [None, None]
    assert "not measured" in (folder / "device.md").read_text()


def test_each_part_is_saved_and_a_failing_codec_says_why(monkeypatch):
    def broken(x):
        raise ValueError("no such codec here")

    monkeypatch.setitem(device.COMPRESSORS, "broken", broken)
    saved = []
    s = device.QUICK
    result = device.run(s, ["broken", "qsgd-4 (bucket 512)"], ["none"], 1.0, lambda line: None,
                        lambda r: saved.append(json.loads(json.dumps(r))))
    broken_row, qsgd_row = result["compressors"]
    assert broken_row == {"compressor": "broken", "error": "ValueError: no such codec here"}
    assert qsgd_row["round_trip_gbs"] > 0
    # After each compressor and before each later part; complete only at the end.
    assert [len(r["compressors"]) for r in saved] == [1, 2, 2, 2, 2]
    assert [r["complete"] for r in saved] == [False] * 4 + [True]
    assert "lm" not in saved[1] and "network" in saved[-1]
    assert "Incomplete" in _device_report.markdown(saved[0])
    assert "Incomplete" not in _device_report.markdown(saved[-1])


def test_profile_of_a_jitted_call():
    fn = jax.jit(lambda x: jnp.sign(x) * jnp.mean(jnp.abs(x)))
    profile = device.profile_of(fn, (jnp.ones((256, 256)),), top=2)
    assert 1 <= len(profile["top"]) <= 2 and profile["total_ms"] > 0
    assert device.profile_of(lambda x: x, (1.0,), top=2)["error"].startswith("AttributeError")


def test_event_times_on_a_gpu_like_trace():
    """A GPU's trace: kernels on the device's timeline with ``_`` for ``.``,
    their launches on the host naming the same operation; the device's count."""
    events = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "name": "launch", "dur": 5.0, "args": {"hlo_op": "fusion.3"}},
        {"ph": "X", "pid": 2, "name": "fusion_3", "dur": 40.0},
        {"ph": "X", "pid": 2, "name": "loop_add_fusion", "dur": 10.0, "args": {}},
        {"ph": "X", "pid": 2, "name": "memcpy", "dur": 99.0},
    ]
    assert _profile.event_times(events, {"fusion.3", "loop_add_fusion"}) == {
        "fusion.3": 40.0, "loop_add_fusion": 10.0}
    host_only = [e for e in events if e["pid"] != 2]
    assert _profile.event_times(host_only, {"fusion.3"}) == {"fusion.3": 5.0}
