"""``python -m qcollect.bench compile``: a tiny run, bad arguments, the timeout."""

import json
import math

import pytest

from qcollect.bench import compile as compile_bench


def _run(tmp_path, *args):
    out = tmp_path / "out"
    assert compile_bench.main([*args, "--out", str(out)]) == 0
    rows = json.loads((out / "compile.json").read_text())
    return {(r["blocks"], r["method"]): r for r in rows}, (out / "compile.md").read_text()


def test_tree_shape_matches_a_transformer_block():
    shapes = compile_bench.block_shapes(512)
    assert len(shapes) == 10
    assert sum(math.prod(s) for s in shapes.values()) \
        == compile_bench.block_params(512) == 3_147_776
    assert [compile_bench.blocks_for(t, 512) for t in (19, 38, 1000)] == [6, 12, 318]


def test_tiny_run_measures_every_size_and_method(tmp_path, capsys):
    # width 16: 3,136 parameters per block; 0.003 and 0.006 million are 1 and 2 blocks.
    rows, text = _run(tmp_path, "--width", "16", "--params", "0.003,0.006",
                      "--methods", "psum,qsgd-4", "--devices", "2", "--runs", "2",
                      "--profile", "3")
    assert set(rows) == {(b, m) for b in (1, 2) for m in ("psum", "qsgd-4")}
    # The profile: the operations with the most device time, named as in the HLO.
    profile = rows[2, "qsgd-4"]["profile"]
    assert 0 < len(profile) <= 3 and all(ms > 0 for _, ms in profile)
    assert [ms for _, ms in profile] == sorted((ms for _, ms in profile), reverse=True)
    assert "### qsgd-4, 6,272 parameters: device time" in text
    assert "| operation | device ms / step | share |" in text
    for (blocks, _), r in rows.items():
        assert r["parameters"] == 3136 * blocks and r["leaves"] == 10 * blocks
        assert r["devices"] == 2 and r["lower_s"] > 0 and r["compile_s"] > 0
        assert r["stablehlo_bytes"] > 0 and r["hlo_bytes"] > 0 and r["step_ms"] > 0
        assert r["temp_bytes"] >= 0
        assert 0 < r["distinct_kernels"] <= r["kernels"] or r["method"] == "psum"
    for blocks in (1, 2):
        assert rows[blocks, "qsgd-4"]["hlo_bytes"] > rows[blocks, "psum"]["hlo_bytes"]
    assert text in capsys.readouterr().out
    assert "| parameters | leaves | psum | qsgd-4 |" in text
    assert "| 6,272 | 20 |" in text and "## qsgd-4" in text and "scratch MB | step ms |" in text
    assert "| kernels | distinct kernels |" in text


def test_profile_needs_runs(capsys):
    with pytest.raises(SystemExit):
        compile_bench.main(["--profile", "3"])
    assert "--profile must be 0 or more and needs --runs" in capsys.readouterr().err


def test_method_batch_suffix():
    import qcollect as qc

    assert compile_bench.parse_method("qsgd-4")[2] == qc.BATCH_BUCKETS
    assert compile_bench.parse_method("qsgd-4/pairwise@always")[1:] == ("pairwise", "always")
    assert compile_bench.parse_method("onebit@never")[2] == "never"
    assert compile_bench.parse_method("onebit@3")[2] == 3
    assert compile_bench.parse_method("onebit@auto")[2] == "auto"


@pytest.mark.parametrize("methods, message", [
    ("psum,gzip", "unknown method 'gzip'"),
    ("qsgd-4/tree", "unknown algorithm 'tree'"),
    ("qsgd-4/ring", "linear compressor"),
    ("psum/ring", "psum takes no algorithm"),
    ("psum@always", "psum takes no algorithm or batch_buckets"),
    ("qsgd-4@-1", "must be 'auto', 'always', 'never' or an int >= 0"),
    ("qsgd-4@none", "must be 'auto', 'always', 'never' or an int >= 0"),
])
def test_unknown_method_is_an_argument_error_naming_it(methods, message, capsys):
    with pytest.raises(SystemExit) as e:
        compile_bench.main(["--methods", methods])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--methods" in err and message in err
    with pytest.raises(ValueError, match=message):
        for m in methods.split(","):
            compile_bench.parse_method(m)


@pytest.mark.slow  # a worker start and a warm-up compile
def test_a_compile_past_the_timeout_is_killed_and_larger_sizes_skipped(tmp_path):
    rows, text = _run(tmp_path, "--width", "16", "--params", "0.003,0.006",
                      "--methods", "qsgd-4", "--devices", "2", "--timeout", "0.05")
    assert rows[1, "qsgd-4"]["timeout"] == 0.05 and "skipped" in rows[2, "qsgd-4"]
    assert "| 3,136 | 10 | > 0.05 s |" in text
