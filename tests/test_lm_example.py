"""The language-model example: its corpus, its model's leaves, and a few training steps."""

import doctest
import importlib
import importlib.util
import json
import math
import os
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from common import compressors, text  # noqa: E402
from lm.config import Config  # noqa: E402

TINY = ["--width", "32", "--depth", "1", "--heads", "2", "--context", "16", "--batch-size", "2",
        "--val-windows", "8", "--warmup-steps", "1", "--progress", "false"]


def _main():
    spec = importlib.util.spec_from_file_location("lm_main", ROOT / "examples" / "lm" / "main.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _leaves(cfg):
    import jax
    from flax import nnx
    from lm.model import build

    return jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: build(cfg))))


@pytest.fixture(scope="module")
def stdlib():
    return text.load_stdlib()


def _pmean_bytes(n: int, values: int) -> float:
    """An XLA all-reduce of ``values`` float32 per device (`qcollect.wire_bytes`)."""
    return 2 * (n - 1) / n * 4 * values


def test_lm_trains_end_to_end_and_measures_its_wire_bytes(tmp_path, capsys):
    """Three steps of ``none`` and ``qsgd-4`` on the 8 simulated devices: finite
    losses, the JSON record, ``none``'s bytes those of an all-reduce of every
    parameter, and ``qsgd-4``'s split measured in two parts that add up."""
    import jax

    results = _main()(["--compressors", "none,qsgd-4,local", "--steps", "3", "--eval-every", "2",
                       "--output-dir", str(tmp_path), *TINY])
    n = jax.device_count()
    cfg = Config(width=32, depth=1, heads=2, context=16)
    sizes = [leaf.size for leaf in _leaves(cfg)]
    for r in results:
        assert len(r.losses) == 3 and np.isfinite(r.losses).all(), r.name
        assert r.steps == [0, 2, 3] and np.isfinite(r.accuracy).all()
        assert 0 < r.accuracy[-1] < 8.5  # bits per byte: about 8 for uniform guesses
    record = json.loads((tmp_path / "lm.json").read_text())
    corpus = record["corpus"]
    assert corpus["files"] == corpus["train_files"] + corpus["val_files"] > 100
    assert corpus["train_bytes"] > 10 * corpus["val_bytes"] > 0 and len(corpus["sha256"]) == 64
    none, qsgd, local = record["runs"]
    for run in (none, qsgd, local):
        assert set(run) >= {"name", "steps", "val_bits_per_byte", "losses", "wire_bytes",
                            "step_seconds", "wire_bytes_compressed", "wire_bytes_uncompressed",
                            "bytes_sent", "step_seconds_beyond_compute"}
        assert len(run["val_bits_per_byte"]) == len(run["steps"]) == len(run["bytes_sent"])
        assert run["bytes_sent"][-1] == 3 * run["wire_bytes"]
    assert none["wire_bytes"] == pytest.approx(_pmean_bytes(n, sum(sizes)), abs=1)
    assert (none["wire_bytes_compressed"], none["wire_bytes_uncompressed"]) == (
        0, none["wire_bytes"])
    assert qsgd["wire_bytes_compressed"] + qsgd["wire_bytes_uncompressed"] == qsgd["wire_bytes"]
    small = sum(s for s in sizes if s < cfg.min_size)
    assert qsgd["wire_bytes_uncompressed"] == pytest.approx(_pmean_bytes(n, small), abs=1)
    assert qsgd["wire_bytes_compressed"] < _pmean_bytes(n, sum(sizes) - small) / 5
    # local: the same step with no all-reduce, what "beyond compute" subtracts
    assert local["wire_bytes"] == local["wire_bytes_compressed"] == 0
    for run in (none, qsgd):
        assert run["step_seconds_beyond_compute"] == pytest.approx(
            run["step_seconds"] - local["step_seconds"])
    out = capsys.readouterr().out
    assert "| qsgd-4 |" in out and "uncompressed leaves" in out
    assert "| local | (no all-reduce) | 0 |" in out and "beyond compute (ms)" in out
    assert (tmp_path / "lm.png").read_bytes()[:4] == b"\x89PNG"


def test_every_large_leaf_is_a_matrix_that_each_compressor_takes():
    """Default model, tied and untied: the leaves under ``min_size`` are vectors
    (biases, LayerNorm), every other leaf a 2-D matrix that PowerSGD, GradiVeQ
    (a slice of whole rows) and the quantizers all compress: over 99% of the values."""
    for tie in (True, False):
        cfg = Config(tie_embeddings=tie)
        leaves = _leaves(cfg)
        big = [leaf.size >= cfg.min_size for leaf in leaves]
        assert big == [leaf.ndim == 2 for leaf in leaves]
        for name in ("qsgd-4", "onebit", "powersgd", "gradiveq"):
            assert compressors.compressed_leaves(name, cfg, leaves) == big, name
        for leaf in leaves:
            if leaf.ndim == 2:
                k = compressors.gradiveq_slice_size(leaf.shape, min_slice=512)
                assert k % leaf.shape[-1] == 0 and leaf.size % k == 0, leaf.shape
        share = sum(leaf.size for leaf, b in zip(leaves, big, strict=True) if b)
        assert share / sum(leaf.size for leaf in leaves) > 0.99
    assert sum(leaf.size for leaf in _leaves(Config())) == 842_496  # the README's count


def test_corpus_is_split_by_document_and_reproducible(stdlib):
    corpus = stdlib
    assert not set(corpus.train_files) & set(corpus.val_files)
    files = text.source_files(corpus.root)
    assert sorted(corpus.train_files + corpus.val_files) == files
    assert list(corpus.val_files) == [f for f in files if text.is_validation(f)]
    assert 0.03 < len(corpus.val_files) / len(files) < 0.12
    assert all(text.is_portable(f) for f in files)
    assert not any(f.startswith(("site-packages/", "test/")) or "/test_" in f for f in files)
    root = pathlib.Path(corpus.root)
    assert corpus.val.size == sum((root / f).stat().st_size + 1 for f in corpus.val_files)
    assert corpus.train[-1] == 0 and corpus.val[-1] == 0  # one NUL after each document
    assert text.load_stdlib().describe() == corpus.describe()


def test_a_new_document_moves_no_other(tmp_path):
    for i in range(40):
        (tmp_path / f"m{i}.py").write_text(f"x = {i}\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("skipped\n")
    before = text.load_stdlib(str(tmp_path), val_percent=30)
    assert before.val_files and before.train_files and "tests/t.py" not in before.train_files
    (tmp_path / "new.py").write_text("y = 1\n")
    after = text.load_stdlib(str(tmp_path), val_percent=30)
    assert set(before.val_files) <= set(after.val_files)
    assert set(before.train_files) <= set(after.train_files)
    assert after.describe()["files"] == 41 and after.sha256 != before.sha256


def test_batches_depend_on_seed_and_step_only(stdlib):
    task = text.NextBytes(stdlib, context=16, val_windows=64)
    straight = list(task.batches(4, 5, seed=0))
    resumed = list(task.batches(4, 5, seed=0, start=3))
    for (x, y), (x2, y2) in zip(straight[3:], resumed, strict=True):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)
    x, y = straight[0]
    assert x.shape == y.shape == (4, 16) and x.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    assert not np.array_equal(x, next(task.batches(4, 1, seed=1))[0])
    assert task.x_val.shape == (64, 16)
    np.testing.assert_array_equal(task.x_val, text.NextBytes(task.corpus, 16, 64).x_val)


def test_config_rejects_mnist_settings_and_bad_shapes(capsys):
    """The MNIST data's flags are not the language model's: the command line
    refuses them rather than ignoring them."""
    from common.config import parse_config

    with pytest.raises(ValueError, match="multiple of heads"):
        Config(width=30, heads=4)
    with pytest.raises(TypeError, match="train_examples"):
        Config(train_examples=100)
    for flag in ("--epochs", "--train-examples", "--test-examples", "--data-dir"):
        with pytest.raises(SystemExit):
            parse_config(Config, [flag, "1"])
        assert f"unrecognized arguments: {flag}" in capsys.readouterr().err
    assert Config().compressor_names == ("none", "qsgd-4", "onebit", "powersgd", "gradiveq")
    # the compute-only run is asked for by name, never part of "all"
    assert "local" in Config(compressors=("none", "local")).compressor_names
    assert "local" not in Config(compressors=("all",)).compressor_names
    with pytest.raises(ValueError, match="compressors must be names"):
        Config(compressors=("loca",))


def test_config_checks_learning_rate_and_output_dir_before_training(tmp_path, capsys):
    """The common checks (through ``super().__post_init__``) cover the language
    model's flags: a non-finite learning rate, an output folder that is a file."""
    from common.config import parse_config

    for value in ("inf", "nan", "0"):
        with pytest.raises(ValueError, match="learning_rate"):
            Config(learning_rate=float(value))
    file = tmp_path / "lm.md"
    file.write_text("")
    with pytest.raises(SystemExit):
        parse_config(Config, ["--output-dir", str(file)])
    assert "output_dir" in capsys.readouterr().err


def test_folders_that_cannot_be_written_are_refused_before_training(tmp_path, capsys):
    """An output or checkpoint folder on a read-only file system (here one
    that no one may write in: a folder without write permission, or /proc
    for root) is refused at the command line, not after training."""
    from common.config import parse_config

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        where = locked if os.geteuid() != 0 else pathlib.Path("/proc")
        for flag in ("--output-dir", "--checkpoint-dir"):
            with pytest.raises(SystemExit):
                parse_config(Config, [flag, str(where / "results")])
            err = capsys.readouterr().err
            assert f"{flag[2:].replace('-', '_')} '{where / 'results'}' cannot be written" in err
        parse_config(Config, ["--output-dir", str(tmp_path / "new" / "results")])
    finally:
        locked.chmod(0o755)


def test_one_bit_adam_recipe_warms_up_uncompressed_then_freezes_the_variance(tmp_path,
                                                                            monkeypatch):
    """``--compress-after 2 --freeze-variance true``: two uncompressed steps
    (the bytes of ``none``), then one-bit; AdamW's second moment stops: after
    step 2 it is exactly what it was at step 2, while the first moment moves."""
    import jax
    import transforms
    from common import train

    moments = []   # (count, nu_count, mu, nu) of onebit's AdamW after each step

    def advance(run, *args):
        losses = advance.original(run, *args)
        (adam,) = [s for s in jax.tree.leaves(run.opt_state, is_leaf=lambda s: isinstance(
            s, transforms.FrozenAdamState)) if isinstance(s, transforms.FrozenAdamState)]
        moments.append((int(adam.count), int(adam.nu_count)) + tuple(
            [np.asarray(x) for x in jax.tree.leaves(m)] for m in (adam.mu, adam.nu)))
        return losses

    advance.original = train._advance
    monkeypatch.setattr(train, "_advance", advance)
    args = ["--steps", "4", "--eval-every", "4", "--output-dir", str(tmp_path), *TINY]
    none, onebit = _main()(["--compressors", "none,onebit", "--compress-after", "2",
                            "--freeze-variance", "true", *args])
    steps = moments[-4:]   # onebit's run (none's steps come first)
    assert [(count, seen) for count, seen, _, _ in steps] == [(1, 1), (2, 2), (3, 2), (4, 2)]
    (_, _, _, nu1), (_, _, mu2, nu2) = steps[:2]
    assert not all(np.array_equal(a, b) for a, b in zip(nu1, nu2, strict=True))
    for _, _, mu, nu in steps[2:]:
        for frozen, now in zip(nu2, nu, strict=True):
            np.testing.assert_array_equal(now, frozen)
        assert not all(np.array_equal(a, b) for a, b in zip(mu2, mu, strict=True))
    assert np.isfinite(onebit.losses).all() and onebit.wire_bytes < none.wire_bytes / 5
    assert onebit.wire_bytes_max == none.wire_bytes
    run = json.loads((tmp_path / "lm.json").read_text())["runs"][1]
    assert run["phase_bytes"] == {"exact": none.wire_bytes,
                                  "compressed": onebit.wire_bytes}
    assert run["bytes_sent"][-1] == 2 * none.wire_bytes + 2 * onebit.wire_bytes
    for bad in (dict(compress_after=0), dict(optimizer="adagrad")):
        with pytest.raises(ValueError, match="freeze_variance"):
            Config(freeze_variance=True, **{"compress_after": 5, **bad})
    with pytest.raises(ValueError, match="compress_after does not apply to gradiveq"):
        compressors.communication("gradiveq", Config(compress_after=3), "d", None)


@pytest.mark.parametrize("name", ["common.config", "common.text", "common.task",
                                  "common.wire_split", "common.report",
                                  "common.compressors", "common.train",
                                  "lm.model", "lm.report", "lm.main",
                                  "lm.frontier", "lm.frontier_report",
                                  "lm.time_to_target"])
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


@pytest.mark.slow  # the example end to end, three times
def test_lm_resume_is_bit_identical(tmp_path):
    """Four steps straight, or two, a checkpoint, and two more after --resume:
    the same losses and validation bits per byte (AdamW's schedule and
    clipping state, onebit's residuals all restored)."""
    main = _main()
    args = ["--compressors", "onebit", "--eval-every", "2", "--checkpoint-every", "2",
            "--output-dir", str(tmp_path), *TINY]
    straight = main(args + ["--steps", "4", "--checkpoint-dir", str(tmp_path / "a")])[0]
    main(args + ["--steps", "2", "--checkpoint-dir", str(tmp_path / "b")])
    resumed = main(args + ["--steps", "4", "--checkpoint-dir", str(tmp_path / "b"),
                           "--resume", "true"])[0]
    assert resumed.losses == straight.losses[2:]
    assert resumed.accuracy == straight.accuracy[1:]
    assert math.isfinite(resumed.accuracy[-1])


@pytest.mark.slow  # two phased runs: their extra compiles
def test_phased_all_reduces_count_each_phase(tmp_path, capsys):
    """PowerSGD's uncompressed first step, GradiVeQ's lead-in, sampling and
    compressed steps: each phase's bytes measured by name on the compiled
    step, summed on the run's schedule into ``bytes_sent``, and the table
    says how many steps each phase took."""
    _main()(["--compressors", "powersgd,gradiveq", "--steps", "4", "--eval-every", "4",
             "--powersgd-start", "1", "--gradiveq-warmup", "1", "--gradiveq-sample-steps", "1",
             "--gradiveq-compressed-steps", "1", "--gradiveq-rank", "4",
             "--output-dir", str(tmp_path), *TINY])
    powersgd, gradiveq = json.loads((tmp_path / "lm.json").read_text())["runs"]
    for run in (powersgd, gradiveq):
        assert run["wire_bytes_compressed"] + run["wire_bytes_uncompressed"] == run["wire_bytes"]
        assert sorted(set(run["phase_bytes"].values())) == [run["wire_bytes"],
                                                             run["wire_bytes_max"]]
    phases = powersgd["phase_bytes"]
    assert set(phases) == {"exact", "compressed"}
    assert powersgd["phases"] == [["exact", 0, 1], ["compressed", 1, 4]]
    assert powersgd["bytes_sent"] == [0, phases["exact"] + 3 * phases["compressed"]]
    phases = gradiveq["phase_bytes"]
    assert phases["lead-in"] == phases["sampling"] == gradiveq["wire_bytes_max"]
    assert phases["compressed"] == gradiveq["wire_bytes"]
    assert gradiveq["phases"] == [["lead-in", 0, 1], ["sampling", 1, 2], ["compressed", 2, 3],
                                  ["sampling", 3, 4]]
    assert gradiveq["bytes_sent"] == [0, phases["lead-in"] + 2 * phases["sampling"]
                                      + phases["compressed"]]
    table = capsys.readouterr().out
    assert (f"1 exact step at {powersgd['phase_bytes']['exact']:,}; "
            f"3 compressed at {powersgd['phase_bytes']['compressed']:,}") in table
    assert f"1 lead-in step at {phases['lead-in']:,}; 2 sampling at" in table


def test_lm_trains_sharded_with_compressed_gathers_and_scatters(tmp_path, capsys):
    """``--parallel fsdp``: parameters and moments held 1/N per device, the
    weights gathered in int8 and the gradients reduce-scattered in 4 bits,
    with fewer bytes than the exact gather and scatter, and the same
    validation loss at step 0."""
    import jax

    results = _main()(["--parallel", "fsdp", "--weight-compressor", "int8", "--fsdp-min-size",
                       "1024", "--compressors", "none,qsgd-4", "--steps", "3", "--eval-every",
                       "3", "--output-dir", str(tmp_path), *TINY])
    none, qsgd = results
    for r in results:
        assert np.isfinite(r.losses).all() and np.isfinite(r.accuracy).all()
        assert set(r.wire_bytes_by_op) >= {"all-gather", "collective-permute", "all-reduce"}
        # a tiny model: its replicated biases and LayerNorms weigh a third
        assert (r.memory["params"] + r.memory["optimizer"]) < 1.5 * r.memory["ideal"]
    assert none.accuracy[0] == qsgd.accuracy[0]
    assert qsgd.wire_bytes_by_op["all-gather"] == none.wire_bytes_by_op["all-gather"]
    assert (qsgd.wire_bytes_by_op["collective-permute"]
            < none.wire_bytes_by_op["collective-permute"] / 5)
    record = json.loads((tmp_path / "lm_fsdp.json").read_text())
    baseline = record["baseline_wire_bytes"]  # the exact gather and scatter
    assert baseline > none.wire_bytes > qsgd.wire_bytes
    total = 4 * sum(leaf.size for leaf in _leaves(Config(width=32, depth=1, heads=2, context=16)))
    assert none.memory["params"] < 1.5 * total / jax.device_count()
    out = capsys.readouterr().out
    assert "vs uncompressed FSDP" in out and "| qsgd-4 |" in out


def test_lm_trains_on_a_data_model_mesh_as_on_the_data_axis(tmp_path, capsys):
    """``--model-parallel 2``: a (data=4, model=2) mesh, twice the batch per
    data replica (the same global batches as 8 data devices). ``none`` gives
    the 8-device run's losses; no gradient byte crosses the model axis
    (``none`` and ``qsgd-4`` send the same there: the model's own
    collectives); the data axis carries an all-reduce of each device's
    blocks; parameters and moments are sharded over the model axis."""
    flat = _main()(["--compressors", "none", "--steps", "3", "--eval-every", "3",
                    "--output-dir", str(tmp_path / "flat"), *TINY])
    none, qsgd = _main()(["--model-parallel", "2", "--compressors", "none,qsgd-4", "--steps",
                          "3", "--eval-every", "3", "--output-dir", str(tmp_path), *TINY,
                          "--batch-size", "4"])
    np.testing.assert_allclose(none.losses, flat[0].losses, rtol=1e-5)
    np.testing.assert_allclose(none.accuracy, flat[0].accuracy, rtol=1e-4)
    assert np.isfinite(qsgd.losses).all() and qsgd.accuracy[0] == none.accuracy[0]
    assert abs(none.wire_bytes_by_axis["model"] - qsgd.wire_bytes_by_axis["model"]) <= 64
    # pmean of each device's blocks over the 4 data devices (ring: 2 (n - 1) / n)
    assert none.wire_bytes_by_axis["data"] == 2 * 3 / 4 * none.memory["params"]
    assert qsgd.wire_bytes_by_axis["data"] < none.wire_bytes_by_axis["data"] / 4
    total = 4 * sum(leaf.size for leaf in _leaves(Config(width=32, depth=1, heads=2, context=16)))
    assert none.memory["params"] < 0.8 * total
    assert qsgd.memory["state"] < 3 * none.memory["params"] + 64  # moments + residuals, sharded
    assert (tmp_path / "lm_model.md").exists()
    assert "by mesh axis" in capsys.readouterr().out


def test_lm_trains_with_diloco_beside_synchronous_runs(tmp_path, capsys):
    """``--diloco-every 2``: the synchronous ``none`` run, then DiLoCo with
    exact and 4-bit outer gradients. A synchronising step sends what one
    synchronous step sends (exact), an inner step nothing, so the mean per
    step is half; the table gives bytes per token and tokens per second."""
    none, exact, four = _main()([
        "--compressors", "none", "--diloco-every", "2", "--outer-compressor", "none,qsgd-4",
        "--steps", "4", "--eval-every", "2", "--output-dir", str(tmp_path), *TINY])
    assert [r.name for r in (exact, four)] == ["diloco-none", "diloco-qsgd-4"]
    for r in (exact, four):
        assert np.isfinite(r.losses).all() and np.isfinite(r.accuracy).all()
        assert r.steps == [0, 2, 4] and r.mean_step_seconds > 0
    assert exact.wire_bytes_max == none.wire_bytes
    assert exact.wire_bytes == round(none.wire_bytes / 2)
    assert four.wire_bytes < exact.wire_bytes / 4
    record = json.loads((tmp_path / "lm_diloco.json").read_text())
    assert [r["name"] for r in record["runs"]] == ["none", "diloco-none", "diloco-qsgd-4"]
    out = capsys.readouterr().out
    assert "bytes / token" in out and "| diloco-qsgd-4 |" in out


@pytest.mark.slow  # two more runs; test_diloco.py's reference holds the synchronous steps first
def test_lm_diloco_warm_start_counts_its_synchronous_steps(tmp_path):
    """``--diloco-sync-first 2``: two synchronous steps (a full exact
    all-reduce each), then rounds of H = 2: 6 steps send 2 + 2 full
    exchanges, two thirds of a synchronous run's bytes."""
    none, warm = _main()([
        "--compressors", "none", "--diloco-every", "2", "--diloco-sync-first", "2",
        "--steps", "6", "--eval-every", "3", "--output-dir", str(tmp_path), *TINY])
    assert np.isfinite(warm.losses).all()
    assert warm.wire_bytes == round(none.wire_bytes * 4 / 6)


def test_diloco_config_is_checked():
    with pytest.raises(ValueError, match="outer_compressor"):
        Config(diloco_every=10, outer_compressor=("powersgd",))
    with pytest.raises(ValueError, match="fragments"):
        Config(diloco_every=4, fragments=5)
    with pytest.raises(ValueError, match="diloco_delay"):
        Config(diloco_every=4, fragments=2, diloco_delay=2)
    with pytest.raises(ValueError, match="diloco_sync_first"):
        Config(diloco_every=4, steps=100, diloco_sync_first=100)
    with pytest.raises(ValueError, match="compressors"):
        Config(compressors=())
    assert Config(compressors=(), diloco_every=4).extra_runs == ("none",)


def test_model_parallel_config_is_checked():
    with pytest.raises(ValueError, match="compressors"):
        Config(model_parallel=2, compressors=("powersgd",))
    with pytest.raises(ValueError, match="model_parallel"):
        Config(model_parallel=2, parallel="fsdp", compressors=("none",))
    with pytest.raises(ValueError, match="model_parallel"):
        Config(model_parallel=0)


def test_fsdp_config_is_checked():
    with pytest.raises(ValueError, match="compressors"):
        Config(parallel="fsdp", compressors=("powersgd",))
    with pytest.raises(ValueError, match="weight_compressor"):
        Config(parallel="fsdp", weight_compressor="int3", compressors=("none",))
    with pytest.raises(ValueError, match="weight_compressor"):
        Config(weight_compressor="int8")
    with pytest.raises(ValueError, match="parallel"):
        Config(parallel="zero", compressors=("none",))


def test_the_frontier_records_each_point_and_resumes(tmp_path, monkeypatch):
    """One point beside ``none`` on a tiny model: seed 0 of each, every seed of
    ``none`` (the point, 50% above it, is not within 10%); the JSON, table and
    plot; a second call runs nothing. (Which seeds run: the test below; 4-bit
    QSGD's bytes: the end-to-end test; several points on one frontier: the
    synthetic runs of the test after it.)"""
    from lm import frontier

    args = ["--only", "onebit-exact10%-frozen", "--seeds", "2", "--within", "0.1",
            "--output-dir", str(tmp_path), "--steps", "10", "--eval-every", "10", *TINY]
    done = frontier.main(args)
    saved = json.loads((tmp_path / "frontier.json").read_text())
    assert saved["steps"] == 10 and {(r["name"], r["seed"]) for r in saved["runs"]} == set(done)
    assert set(done) == {("none", 0), ("none", 1), ("onebit-exact10%-frozen", 0)}
    points = {p["name"]: p for p in saved["points"]}
    assert points["none"]["seeds"] == 2 and points["none"]["vs_none"] == 0.0
    # onebit's exact steps (1 of 10) weigh in: between onebit's and none's bytes
    warm = done[("onebit-exact10%-frozen", 0)]
    assert warm["settings"]["compress_after"] == 1 and warm["settings"]["freeze_variance"]
    assert points["none"]["bytes_per_step"] / 10 < warm["bytes_per_step"] < points["none"][
        "bytes_per_step"] / 5
    table = (tmp_path / "frontier.md").read_text()
    assert "| onebit-exact10%-frozen |" in table
    # the gap along the run: none against itself is 0 at every evaluation
    assert "| none | +0.0% | +0.0% |" in table.split("Against none along the run")[1]
    assert (tmp_path / "frontier.png").stat().st_size > 0
    assert (tmp_path / "frontier_gap.png").stat().st_size > 0
    monkeypatch.setattr(frontier, "measure", lambda *a: pytest.fail("ran again"))
    assert frontier.main(args) == done
    with pytest.raises(ValueError, match="holds runs of 10 steps"):
        frontier.main([*args, "--steps", "12"])


def test_the_frontier_runs_every_seed_of_none_and_of_the_points_close_to_it():
    """Seed 0 of every point first; once none's seed 0 is known, the other
    seeds of none and of each point within ``within`` of it, not of the rest."""
    from lm import frontier

    names = ["none", "near", "far"]
    assert frontier.plan(names, 3, {}, 0.05) == [("none", 0), ("near", 0), ("far", 0)]
    done = {("none", 0): {"val_bits_per_byte": 2.0}, ("near", 0): {"val_bits_per_byte": 2.09},
            ("far", 0): {"val_bits_per_byte": 2.2}}
    assert frontier.plan(names, 3, done, 0.05) == [("none", 1), ("none", 2), ("near", 1),
                                                   ("near", 2)]
    assert frontier.plan(names, 3, done, 0.2)[-2:] == [("far", 1), ("far", 2)]
    done.update({(n, s): done[(n, 0)] for n in ("none", "near") for s in (1, 2)})
    assert frontier.plan(names, 3, done, 0.05) == []
    assert frontier.plan(names, 1, {("near", 0): done[("near", 0)]}, 0.05) == [
        ("none", 0), ("far", 0)]


def test_frontier_names_say_the_exact_steps_as_a_share_and_read_old_records(tmp_path,
                                                                          monkeypatch):
    """A 1,800-step run names its points as a 600-step run does, with three
    times the exact steps; a record of the names that said 600-step counts
    (``onebit-w120-frozen``, run for 1,800 steps with 360 exact) is read
    under today's names, and nothing runs again."""
    from lm import frontier, frontier_report

    short, long = frontier.points(600), frontier.points(1800)
    assert list(short) == list(long) and len(short) == len(frontier.POINTS)
    assert short["onebit-exact20%-frozen"]["compress_after"] == 120
    assert long["onebit-exact20%-frozen"]["compress_after"] == 360
    assert long["qsgd-4-exact10%"]["compress_after"] == 180
    assert long["diloco-h10-none"]["diloco_sync_first"] == 360
    assert not [n for n in short if "-w60" in n or "-w120" in n]

    def run(name, **settings):
        return {"name": name, "seed": 0, "val_bits_per_byte": 2.0, "curve": [[0, 4.0], [9, 2.0]],
                "bytes_per_step": 1.0, "settings": settings}

    old = [run("none", compressors=["none"]),
           run("onebit-w120-frozen", compressors=["onebit"], compress_after=360,
               freeze_variance=True),
           run("qsgd-4-w60", compressors=["qsgd-4"], compress_after=180)]
    frontier_report.store(tmp_path / "frontier.json", 1800, {(r["name"], 0): r for r in old})
    monkeypatch.setattr(frontier, "measure", lambda *a: pytest.fail("ran again"))
    done = frontier.main(["--only", "onebit-exact20%-frozen,qsgd-4-exact10%", "--seeds", "1",
                          "--output-dir", str(tmp_path), "--steps", "1800", *TINY])
    assert set(done) == {("none", 0), ("onebit-exact20%-frozen", 0), ("qsgd-4-exact10%", 0)}
    assert done[("qsgd-4-exact10%", 0)]["name"] == "qsgd-4-exact10%"
    assert "| onebit-exact20%-frozen |" in (tmp_path / "frontier.md").read_text()
    saved = json.loads((tmp_path / "frontier.json").read_text())
    assert {r["name"] for r in saved["runs"]} == {n for n, _ in done}


def test_time_to_target_times_each_phase_of_a_point(tmp_path, capsys):
    """A frontier of four points and step times at two rates: steps to none's
    final loss from the interpolated curves, seconds summed by phase (exact
    steps at none's time, DiLoCo's inner steps at local's and one
    outer exchange per round), a point that never reaches the target."""
    from lm import time_to_target

    def run(name, values, **settings):
        return {"name": name, "seed": 0, "val_bits_per_byte": values[-1],
                "curve": [[s, v] for s, v in zip((0, 10, 20), values, strict=True)],
                "bytes_per_step": {"none": 100.0}.get(name, 10.0), "settings": settings}

    runs = [run("none", [4.0, 3.0, 2.0], compressors=["none"]),
            run("qsgd-4-w10", [4.0, 2.5, 1.5], compressors=["qsgd-4"], compress_after=10),
            run("powersgd-r4", [4.0, 3.5, 2.5], compressors=["powersgd"], powersgd_rank=4,
                powersgd_start=5),
            run("diloco", [4.0, 2.0, 1.0], compressors=[], diloco_every=4,
                outer_compressor=["qsgd-4"], diloco_sync_first=2)]
    from lm import frontier_report
    frontier_report.store(tmp_path / "frontier.json", 20,
                          {(r["name"], 0): r for r in runs})
    for rate, scale in ((100, 1.0), (25, 4.0)):
        folder = tmp_path / f"steps_{rate}mbit"
        folder.mkdir()
        steps = {"none": 1.0, "local": 0.25, "qsgd-4": 0.5, "powersgd": 0.4}
        (folder / "lm.json").write_text(json.dumps({
            "config": {"powersgd_rank": 4},
            "runs": [{"name": n, "step_seconds": scale * t} for n, t in steps.items()]}))
    out = {r["name"]: r for r in time_to_target.main(["--frontier", str(tmp_path)])}
    assert out["none"]["steps"] == 20 and out["none"]["seconds"] == {100: 20.0, 25: 80.0}
    # 2.0 reached two thirds of the way from step 10 (2.5) to 20 (1.5)
    assert out["qsgd-4-w10"]["steps"] == pytest.approx(15.0)
    assert out["qsgd-4-w10"]["seconds"][100] == pytest.approx(10 * 1.0 + 5 * 0.5)
    assert out["powersgd-r4"]["steps"] is None and out["powersgd-r4"]["seconds"][25] is None
    # step 10: 2 synchronous steps, 8 inner steps, 2 outer rounds
    assert out["diloco"]["steps"] == pytest.approx(10.0)
    assert out["diloco"]["seconds"][25] == pytest.approx(4 * (2 + 8 * 0.25 + 2 * 0.25))
    table = capsys.readouterr().out
    assert "| none | 100 | +0.0% | 1 | 20 | 20 | 1.00x | 80 | 1.00x |" in table
    assert "| powersgd-r4 |" in table and "not reached" in table
    assert (tmp_path / "time_to_target.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SystemExit):
        time_to_target.main(["--frontier", str(tmp_path), "--rates", "10"])
    # within 25% of none's 2.0: powersgd-r4 reaches 2.5 at its last step
    loose = {r["name"]: r for r in time_to_target.main(
        ["--frontier", str(tmp_path), "--within", "0.25"])}
    assert loose["powersgd-r4"]["steps"] == pytest.approx(20.0)
    assert loose["none"]["steps"] == pytest.approx(10.0 + 10 * 0.5 / 1.0)
    assert "25% above none's mean" in (tmp_path / "time_to_target_25pct.md").read_text()
    with pytest.raises(SystemExit):
        time_to_target.main(["--frontier", str(tmp_path), "--within", "-0.1"])


def test_lm_trains_with_the_optimizers_that_compress_inside(tmp_path):
    """1-bit Adam after a bfloat16 warm-up (phases ``lead-in`` then
    ``compressed``, the warm-up half of float32's bytes), 0/1 Adam on one
    replica per device (bfloat16 refreshes, a sync and a local step, the
    local step sending nothing) and DeMo (an all-gather of 3 bytes per sent
    coefficient): finite, and each measured."""
    import jax

    n = jax.device_count()
    cfg = Config(width=32, depth=1, heads=2, context=16)
    sizes = [leaf.size for leaf in _leaves(cfg)]
    onebit = _main()(["--optimizer", "onebit-adam", "--compressors", "onebit-column",
                      "--compress-after", "1", "--warm-up-compressor", "bf16", "--steps", "2",
                      "--output-dir", str(tmp_path / "a"), *TINY])
    demo = _main()(["--optimizer", "demo", "--compressors", "none", "--demo-top-k", "1",
                    "--steps", "1", "--output-dir", str(tmp_path / "b"), *TINY])
    zero_one = _main()(["--optimizer", "zero-one-adam", "--compressors", "onebit",
                        "--zero-one-freeze", "2", "--zero-one-refreshes", "1",
                        "--zero-one-local-steps", "2", "--zero-one-syncs", "1",
                        "--zero-one-refresh", "bf16", "--steps", "4",
                        "--output-dir", str(tmp_path / "c"), *TINY])
    for r in onebit + demo + zero_one:
        assert np.isfinite(r.losses).all() and np.isfinite(r.accuracy).all(), r.name
    (adam,), (demo,), (zero,) = onebit, demo, zero_one
    # bfloat16 refreshes at 0 and 1, a sync at 2, a local step at 3
    assert [span[0] for span in zero.phases] == ["lead-in", "compressed", "inner"]
    phases = zero.wire_bytes_by_phase
    assert phases["inner"] == 0 and 0 < phases["compressed"] < phases["lead-in"] / 2
    assert phases["lead-in"] == pytest.approx(_pmean_bytes(n, sum(sizes)) / 2, rel=0.01)
    assert [span[0] for span in adam.phases] == ["lead-in", "compressed"]
    lead_in, compressed = adam.wire_bytes_by_phase["lead-in"], adam.wire_bytes_by_phase[
        "compressed"]
    small = sum(s for s in sizes if s < cfg.min_size)
    assert lead_in == pytest.approx(_pmean_bytes(n, sum(sizes) - small) / 2
                                    + _pmean_bytes(n, small), abs=2)
    assert compressed < lead_in / 4    # the small leaves go exact
    chunks = sum(math.ceil(s / 64) for s in sizes)
    assert demo.wire_bytes == (n - 1) * chunks * 3
    for bad in (dict(optimizer="demo", compressors=("qsgd-4",)),
                dict(optimizer="onebit-adam", compressors=("onebit",), compress_after=0),
                dict(optimizer="onebit-adam", compressors=("powersgd",), compress_after=2),
                dict(optimizer="zero-one-adam", compressors=("onebit",)),
                dict(optimizer="zero-one-adam", compressors=("onebit",), zero_one_freeze=5,
                     zero_one_refresh="qsgd-8"),
                dict(optimizer="zero-one-adam", compressors=("onebit",), zero_one_freeze=5,
                     compress_after=2),
                dict(optimizer="zero-one-adam", compressors=("onebit",), zero_one_freeze=5,
                     parallel="fsdp")):
        with pytest.raises(ValueError, match="optimizer"):
            Config(**bad)
