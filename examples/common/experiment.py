"""One experiment: every requested compressor trained from the same start,
then the table (printed), the JSON record and the accuracy plot."""

from __future__ import annotations

import sys

import jax
import optax

import qcollect as qc
from common import report
from common.devices import data_mesh
from common.mnist import load_mnist
from common.task import as_task
from common.train import DataParallel, InOptimizer, make_optimizer, train, with_image_shape


def baseline_wire_bytes(dp: DataParallel, cfg, data, optimizer=None) -> int:
    """Wire bytes per step of the uncompressed baseline (compiled, not run):
    ``lax.pmean`` of the gradients, or under FSDP the exact gather and
    reduce-scatter (`DataParallel.uncompressed`).

    ``data``: an `MNIST` or a `common.task.Task` (its first batch sets the
    shapes); ``optimizer``: as in `train`.
    """
    dp = dp.uncompressed()
    comm = dp.communication(report.BASELINE, cfg, jax.random.key(cfg.seed))
    optimizer = make_optimizer(cfg) if optimizer is None else optimizer
    tx = optax.chain(comm.tx, optax.identity() if isinstance(optimizer, InOptimizer)
                     else optimizer)
    params = dp.place(dp.params)
    state = dp.init(tx, params)
    x, y = next(as_task(data).batches(cfg.batch_size * dp.num_devices, 1, cfg.seed))
    return qc.wire_bytes(dp.step(tx, state), params, state, *dp.batch(x, y))


def progress_bar(total: int, desc: str, initial: int = 0):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"{desc:>9}", unit="step", leave=True, file=sys.stderr,
                dynamic_ncols=True, initial=initial)


def prepare(cfg, build_model, image_shape, data=None, mesh=None):
    """The model of ``cfg`` on its mesh and the data cut and shaped for it.

    Args:
      cfg: an `MNISTConfig` (``train_examples``, ``test_examples``, ``mesh``,
        ``nodes`` and ``data_dir`` are read here).
      build_model: ``cfg -> nnx.Module``.
      image_shape: the model's input shape, e.g. ``(784,)`` or ``(28, 28, 1)``.
      data: an `MNIST` (default: `load_mnist` of ``cfg.data_dir``).
      mesh: the mesh (default: `mesh_of` ``cfg``).

    Returns:
      ``(dp, data)``: a `DataParallel` (`data_parallel`) and the data the runs train on.
    """
    if data is None:
        data = load_mnist(cfg.data_dir or None)
    data = data.take(cfg.train_examples or None, cfg.test_examples or None)
    data = with_image_shape(data, image_shape)
    mesh = mesh_of(cfg) if mesh is None else mesh
    return data_parallel(cfg, build_model(cfg), mesh), data


def mesh_of(cfg):
    """The mesh of ``cfg``: `common.devices.data_mesh` of ``cfg.mesh``, or with
    ``cfg.model_parallel > 1`` a ``(data, model)`` mesh (`common.model_axes`)."""
    if cfg.model_parallel > 1:
        from common.model_axes import model_mesh

        return model_mesh(cfg.model_parallel)
    return data_mesh(cfg.mesh, cfg.nodes)


def data_parallel(cfg, model, mesh) -> DataParallel:
    """``model`` on ``mesh`` as ``cfg`` says: replicated parameters, sharded
    (``parallel`` fsdp: `common.fsdp.ShardedDataParallel`), or model-sharded
    over a model axis (``model_parallel`` > 1: `common.model_axes.DataModelParallel`), one
    replica per device (0/1 Adam's local steps: `common.replicas.ReplicaParallel`)."""
    if cfg.model_parallel > 1:
        from common.model_axes import DataModelParallel

        return DataModelParallel(model, mesh)
    if cfg.optimizer == "zero-one-adam":
        from common.replicas import ReplicaParallel

        return ReplicaParallel(model, mesh)
    if cfg.parallel == "fsdp":
        from common.compressors import feedback
        from common.fsdp import ShardedDataParallel

        return ShardedDataParallel(model, mesh, weight_compressor=cfg.weight_compressor,
                                   min_size=cfg.fsdp_min_size,
                                   error_feedback=feedback(cfg.fsdp_error_feedback))
    return DataParallel(model, mesh)


def devices_line(dp: DataParallel) -> str:
    """``"N devices (mesh shape, platform)"``, with the process count when several."""
    shape = " x ".join(f"{size} {name}" for name, size in dp.mesh.shape.items())
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    return f"{dp.mesh.size} devices{processes} ({shape}, {jax.devices()[0].platform})"


def describe(dp: DataParallel, data, cfg, title: str) -> str:
    """One line: parameters, devices, mesh, platform, training images, global batch."""
    params = sum(x.size for x in jax.tree.leaves(dp.params))
    return (f"{title}: {params:,} parameters, {devices_line(dp)}, "
            f"{len(data.x_train):,} training images "
            f"({data.source}), global batch {cfg.batch_size * dp.num_devices}")


def train_each(dp: DataParallel, cfg, data, lead: bool = True, optimizer=None) -> list:
    """`train` with each of ``cfg.compressor_names`` from the same start, in order
    (a progress bar per run when ``cfg.progress`` and ``lead``; ``optimizer``
    as in `train`)."""
    bar = progress_bar if cfg.progress and lead else None
    return [train(dp, name, cfg, data, progress=bar, optimizer=optimizer)
            for name in cfg.compressor_names]


def run(cfg, build_model, image_shape, stem: str, title: str, data=None):
    """Trains ``build_model(cfg)`` with each of ``cfg.compressor_names``.

    Returns the list of `RunResult`. Process 0 prints the table and writes
    ``{output_dir}/{stem}.{md,json,png}``.
    """
    dp, data = prepare(cfg, build_model, image_shape, data)
    lead = jax.process_index() == 0
    if lead:
        print(describe(dp, data, cfg, title), flush=True)
    results = train_each(dp, cfg, data, lead)
    base = baseline_bytes(results, dp, cfg, data)
    if lead:
        files = report.save(results, base, cfg, cfg.output_dir, stem, title)
        print(files["table"].read_text(), end="")
        print(f"wrote {files['table']}, {files['json']} and {files['plot']}")
    return results


def baseline_bytes(results, dp: DataParallel, cfg, data, optimizer=None) -> int:
    """The baseline's wire bytes per step: the ``none`` run's when it ran
    uncompressed (not with compressed weights under FSDP, nor inside an
    optimizer that compresses, `common.train.InOptimizer`), else compiled
    (`baseline_wire_bytes`)."""
    uncompressed = ((cfg.parallel != "fsdp" or cfg.weight_compressor == "none")
                    and not isinstance(make_optimizer(cfg), InOptimizer))
    base = next((r.wire_bytes for r in results if r.name == report.BASELINE and uncompressed),
                None)
    return baseline_wire_bytes(dp, cfg, data, optimizer) if base is None else base
