"""``python -m qcollect.bench network``: a short run on two unshaped processes."""

import csv
import pathlib
import subprocess
import sys

import pytest

from qcollect.bench import network

_METHODS = "psum,psum-bf16,ring,cast-bf16,qsgd-4,onebit,pca"


def _bench(*args, timeout=240):
    return subprocess.run([sys.executable, "-m", "qcollect.bench", "network", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("network") / "net"
    run = _bench("--nproc", "2", "--bandwidth", "none", "--sizes", "0.0625,0.25",
                 "--repeats", "2", "--methods", _METHODS, "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert out.with_suffix(".png").stat().st_size > 1000
    assert out.with_suffix(".md").read_text().count("\n") == 2 + 2 * 7
    with open(out.with_suffix(".csv")) as f:
        return {(float(r["mib"]), r["method"]): r for r in csv.DictReader(f)}


def test_every_size_and_method_is_measured(rows):
    assert set(rows) == {(mib, m) for mib in (0.0625, 0.25) for m in _METHODS.split(",")}
    for r in rows.values():
        assert int(r["processes"]) == 2 and float(r["median_ms"]) > 0


def test_uncompressed_methods_are_exact_and_psum_sized(rows):
    for mib in (0.0625, 0.25):
        psum = rows[(mib, "psum")]
        assert float(psum["relative_error"]) == 0.0
        assert float(rows[(mib, "ring")]["relative_error"]) < 1e-6
        # Two processes: a ring all-reduce sends the whole buffer once.
        assert int(psum["wire_bytes"]) == int(rows[(mib, "ring")]["wire_bytes"]) == mib * 2**20
        # A bfloat16 lax.psum: rounded to 16 bits, summed (and sent) as float32 on XLA:CPU.
        half = rows[(mib, "psum-bf16")]
        assert 0 < float(half["relative_error"]) < 1e-2
        assert int(half["wire_bytes"]) == int(psum["wire_bytes"])


def test_compressed_methods_send_fewer_bytes_with_bounded_error(rows):
    ratio = {m: float(rows[(0.25, m)]["wire_vs_psum"]) for m in _METHODS.split(",")}
    assert ratio["cast-bf16"] == pytest.approx(2.0)
    assert ratio["qsgd-4"] > 7.5 and ratio["onebit"] > 15 and ratio["pca"] > 7.5
    error = {m: float(rows[(0.25, m)]["relative_error"]) for m in _METHODS.split(",")}
    assert 0 < error["cast-bf16"] < 1e-2
    assert 0 < error["pca"] < 0.1
    assert 0 < error["qsgd-4"] < 1 and 0 < error["onebit"] < 1


def test_launch_command_runs_this_file_under_the_launcher():
    cmd = network.launch_command(["--sizes", "1"], 4, "1gbit", 2)
    assert cmd[1:9] == ["-m", "qcollect.launch", "--nproc", "4", "--devices-per-process", "2",
                        "--bandwidth", "1gbit"]
    assert cmd[-3:] == [str(pathlib.Path(network.__file__).resolve()), "--sizes", "1"]
    assert "--bandwidth" not in network.launch_command([], 2, "none")


@pytest.mark.parametrize("args, message", [
    (["--methods", "psum,gzip"], "--methods"),
    (["--sizes", "0"], "--sizes"),
    (["--sizes", "a,b"], "--sizes"),
    (["--repeats", "0"], "--repeats"),
    (["--nproc", "0"], "--nproc"),
    (["--pipeline", "0"], "--pipeline"),
    (["--pipeline", "two"], "--pipeline"),
    (["--batch-buckets", "some"], "--batch-buckets"),
    (["--exchange", "all_to_all,gossip"], "--exchange"),
    (["--leaves", "0"], "--leaves"),
    (["--bucket-mib", "0"], "--bucket-mib"),
    (["--devices-per-process", "0"], "--devices-per-process"),
])
def test_bad_arguments_exit_2_naming_the_argument(args, message, capsys):
    """In this process (the command line itself runs in the `rows` fixture): the
    arguments are checked before anything is launched."""
    with pytest.raises(SystemExit) as exit_info:
        network.main(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_swap_probe_times_one_swap_and_its_pieces(tmp_path):
    out = tmp_path / "swap"
    run = _bench("--nproc", "2", "--bandwidth", "none", "--swap-probe", "--sizes", "2",
                 "--repeats", "1", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    header, rule, row = out.with_suffix(".md").read_text().splitlines()
    assert "one collective-permute" in header and "pieces" in header
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "2" and all(float(c) > 0 for c in cells[1:4])
    # Across processes the 2 MiB swap goes in 256 KiB pieces: 8 collective-permutes.
    assert cells[4] == "1 / 8"


def test_message_probe_shows_what_each_array_of_a_collective_costs(tmp_path):
    """Across processes on the CPU backend each array of an all-reduce is an
    exchange of its own: the reason qcollect sends one buffer per collective
    (`qcollect.collectives._messages`). If a backend stops charging per array, the
    timing assertion fails and the packing can go."""
    out = tmp_path / "messages"
    run = _bench("--nproc", "2", "--bandwidth", "none", "--message-probe", "--sizes", "0.0625",
                 "--repeats", "3", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    header, rule, *rows = out.with_suffix(".md").read_text().splitlines()
    assert "one per array ms" in header and "one buffer ms" in header
    cells = {r.split("|")[2].strip(): [c.strip() for c in r.strip("|").split("|")] for r in rows}
    assert set(cells) == {"1 (psum)", "8 (psum)", "34 (psum)", "128 (psum)",
                          "one-bit payload (ppermute)"}
    for k in (1, 8, 34, 128):
        assert cells[f"{k} (psum)"][4] == f"{k} / 1"  # arrays in the compiled collectives
    assert cells["one-bit payload (ppermute)"][4] == "1+1+1 / 1"
    apart, packed = (float(c) for c in cells["128 (psum)"][2:4])
    assert apart > 4 * packed, (apart, packed)


@pytest.mark.slow  # a probe mode: two more launched processes
def test_node_probe_times_the_collectives_inside_a_node(tmp_path):
    out = tmp_path / "node"
    run = _bench("--nproc", "2", "--devices-per-process", "2", "--bandwidth", "none",
                 "--node-probe", "--sizes", "0.25", "--repeats", "1", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    header, rule, row = out.with_suffix(".md").read_text().splitlines()
    assert "psum_scatter ms" in header and "ring reduce-scatter ms" in header
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "0.25" and len(cells) == 6 and all(float(c) > 0 for c in cells[1:])
    assert _bench("--node-probe", timeout=60).returncode == 2


def test_floors_bound_every_row_and_rewrite_the_table(rows, tmp_path):
    """The two floors and the efficiency, from a shaped run's CSV and an unshaped one's."""
    shaped, unshaped = tmp_path / "shaped", tmp_path / "shaped_unshaped"
    fields = list(next(iter(rows.values())))
    for path, scale in ((shaped, 3.0), (unshaped, 1.0)):
        with open(path.with_suffix(".csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(dict(r, median_ms=scale * float(r["median_ms"]))
                             for r in rows.values())
    rate = 100_000_000
    network.add_floors(shaped, unshaped, rate)
    with open(shaped.with_suffix(".csv")) as f:
        merged = list(csv.DictReader(f))
    assert len(merged) == len(rows)
    for r in merged:
        wire_floor = 1e3 * 8 * int(r["wire_bytes"]) / rate
        assert float(r["wire_floor_ms"]) == pytest.approx(wire_floor)
        assert float(r["unshaped_ms"]) == pytest.approx(float(r["median_ms"]) / 3)
        floor = max(wire_floor, float(r["unshaped_ms"]))
        assert float(r["efficiency"]) == pytest.approx(floor / float(r["median_ms"]))
        assert float(r["of_wire_ratio"]) == pytest.approx(
            float(r["speedup_vs_psum"]) / float(r["wire_vs_psum"]))
    text = shaped.with_suffix(".md").read_text()
    assert "| wire floor ms | transport ms | unshaped ms | efficiency |" in text
    assert text.count("\n") == 2 + len(rows)


def test_pipeline_counts_name_one_row_per_compressed_method_and_count():
    from qcollect.bench import _network

    assert _network.variants(["psum", "ring", "onebit", "pca"], [1, 4]) == [
        "psum", "ring", "onebit", "onebit/p4", "pca", "pca/p4"]
    assert _network.variants(["psum", "onebit"], [1, 4], batches=("always", "never")) == [
        "psum", "onebit@always", "onebit@never", "onebit/p4@always", "onebit/p4@never"]
    assert _network.variants(["psum", "onebit"], [1], exchanges=("all_to_all", "permute")) == [
        "psum", "onebit:all_to_all", "onebit:permute"]


def test_one_all_to_all_beside_the_shifts_across_processes(tmp_path):
    """--exchange: each compressed method once per exchange, across two processes:
    the same bytes, and pairwise the same sums bit for bit."""
    out = tmp_path / "net"
    run = _bench("--nproc", "2", "--bandwidth", "none", "--sizes", "0.0625",
                 "--exchange", "all_to_all,permute", "--repeats", "1",
                 "--methods", "psum,onebit,pca", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(out.with_suffix(".csv")) as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"psum", "onebit:all_to_all", "onebit:permute", "pca:all_to_all",
                         "pca:permute"}
    for m in ("onebit", "pca"):
        one, shifts = rows[f"{m}:all_to_all"], rows[f"{m}:permute"]
        assert int(one["wire_bytes"]) == int(shifts["wire_bytes"]) > 0
        assert 0 < float(one["relative_error"]) < 1
    assert rows["onebit:all_to_all"]["relative_error"] == rows["onebit:permute"]["relative_error"]


@pytest.mark.slow  # two processes; the batch == traced equivalence runs in tests/test_buckets.py
def test_a_batch_of_equal_buckets_beside_the_program_traced_per_bucket(tmp_path):
    """Four leaves of one 64 KiB bucket each: @always reduces them as one
    batch, @never bucket by bucket; the same bytes and the same draws, so the same sums."""
    out = tmp_path / "net"
    run = _bench("--nproc", "2", "--bandwidth", "none", "--sizes", "0.25", "--leaves", "4",
                 "--bucket-mib", "0.0625", "--batch-buckets", "always,never", "--repeats", "2",
                 "--methods", "psum,qsgd-4", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(out.with_suffix(".csv")) as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"psum", "qsgd-4@always", "qsgd-4@never"}
    assert all(int(r["leaves"]) == 4 and float(r["median_ms"]) > 0 for r in rows.values())
    batch, traced = rows["qsgd-4@always"], rows["qsgd-4@never"]
    assert int(batch["wire_bytes"]) == int(traced["wire_bytes"]) > 0
    assert 0 < float(batch["relative_error"]) < 1
    assert float(batch["relative_error"]) == pytest.approx(float(traced["relative_error"]),
                                                           rel=1e-5)


def test_transport_only_moves_the_compressors_bytes_without_its_codec():
    """The transport floor's stand-in sends exactly the real payload's bytes."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import qcollect as qc
    from qcollect.bench import _network

    mesh = jax.make_mesh((4,), ("d",), devices=jax.devices()[:4])
    x = jax.device_put(jnp.ones((4, 4096)), NamedSharding(mesh, P("d")))
    for c in (qc.onebit(), qc.qsgd(bits=8), qc.cast("bfloat16"), qc.adaptive(grouping="bucket")):
        real, moved = (jax.jit(jax.shard_map(
            lambda v, c=cc: qc.compressed_all_reduce(v[0], "d", c, jax.random.key(0)).value,
            mesh=mesh, in_specs=P("d"), out_specs=P())) for cc in (c, _network.transport_only(c)))
        assert qc.wire_bytes(moved, x) == qc.wire_bytes(real, x) > 0
        ops = [op.op for op in qc.wire_report(moved, x)]
        assert ops == [op.op for op in qc.wire_report(real, x)]


@pytest.mark.slow  # four worker processes
def test_nodes_of_several_devices_measure_the_hierarchical_all_reduce(tmp_path):
    """Two processes of two devices: every compressed method also as METHOD/h, which
    sends across nodes at most 1/(L x compression) of psum's bytes; the wire
    floor counts a process's devices' bytes across nodes."""
    from qcollect.bench import _network

    out = tmp_path / "nodes"
    run = _bench("--nproc", "2", "--devices-per-process", "2", "--bandwidth", "none",
                 "--sizes", "0.0625", "--repeats", "1", "--methods", "psum,qsgd-4,onebit",
                 "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(out.with_suffix(".csv")) as f:
        got = {r["method"]: r for r in csv.DictReader(f)}
    assert list(got) == ["psum", "qsgd-4", "qsgd-4/h", "onebit", "onebit/h"]
    across = {m: int(r["across_nodes_bytes"]) for m, r in got.items()}
    local, ratio = 2, {"qsgd-4": 7.5, "onebit": 15}
    for m, r in ratio.items():
        assert across[m + "/h"] <= across["psum"] / (local * r)
        assert across[m + "/h"] < across[m] <= int(got[m]["wire_bytes"])
        assert float(got[m + "/h"]["wire_vs_psum"]) == pytest.approx(
            across["psum"] / across[m + "/h"])
        assert 0 < float(got[m + "/h"]["relative_error"]) < 1
    # Each device sends its share to the other node: a process's link carries both.
    assert _network.link_bytes(got["onebit/h"]) == local * across["onebit/h"]
    # psum over all four devices in process order: Gloo's ring crosses once.
    assert _network.link_bytes(got["psum"]) == across["psum"]
    assert "across nodes / device" in out.with_suffix(".md").read_text()


def test_one_process_of_several_devices_measures_without_nodes():
    """In one process of 8 devices nothing crosses between nodes: the rows'
    byte ratios are the wire bytes', with no node grid."""
    from qcollect.bench import _network

    rows = _network.measure([0.0625], ["psum", "qsgd-4"], repeats=1)
    assert _network.meshes()[1] is None
    by_method = {r["method"]: r for r in rows}
    assert by_method["psum"]["wire_vs_psum"] == 1.0
    assert by_method["qsgd-4"]["wire_vs_psum"] == pytest.approx(
        by_method["psum"]["wire_bytes"] / by_method["qsgd-4"]["wire_bytes"])
    assert by_method["qsgd-4"]["wire_vs_psum"] > 6
    assert "across_nodes_bytes" not in by_method["qsgd-4"]
