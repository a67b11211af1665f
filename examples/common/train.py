"""Data-parallel training of a Flax NNX model with `jax.shard_map`.

One loop for every example: a `common.task.Task` gives the batches and
the evaluation (`Classification` of MNIST images, test accuracy;
`common.text.NextBytes` of text windows, validation bits per byte), the
model maps a batch of inputs to logits and the loss is their cross-entropy
against the targets.

The mesh is one axis ``"data"`` over every device, or ``("node", "local")``
(nodes of devices): the gradients are then reduced hierarchically,
uncompressed inside a node and compressed across nodes.

The pattern (README, "Train"): parameters and optimizer moments are
replicated, ``P()``; only the error-feedback residuals are per device
(`transforms.init_sharded`, `transforms.state_specs`). Inside the mapped
step each device takes gradients on its share of the global batch at
``lax.pcast(params, "data", to="varying")`` (its own gradients, not an
implicit psum), and the optax chain ``communication -> optimizer``
all-reduces them into an update that is the same on every device.
With ``--parallel fsdp``, `common.fsdp.ShardedDataParallel` shards the
parameters and the optimizer state over the data axis instead and gathers
and reduce-scatters them in the step (`transforms.fsdp`).
Every step is awaited (``jax.block_until_ready``): XLA:CPU's in-process
collectives can deadlock when several collective programs are queued.

MNIST batches are cut from one global permutation per epoch (same seed,
same order for every compressor); with several processes
(``jax.distributed``) each process feeds its devices' rows
(``jax.make_array_from_process_local_data``).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
import transforms
from common import entropy_plan
from common.checkpoints import Checkpoints, step_of
from common.compressors import (
    Communication,
    communication,
    compress_after_of,
    zero_one_schedule,
)
from common.devices import local_values
from common.task import as_task

AXIS = "data"


@dataclasses.dataclass
class RunResult:
    """What one training run measured.

    Attributes:
      name: compressor name.
      steps / accuracy: evaluation points: step count and the task's
        evaluation (`common.task.Task.evaluate`): test accuracy for MNIST,
        validation bits per byte for the language model (the field keeps
        the name of the MNIST records).
      losses: mean training loss of every step.
      wire_bytes: bytes each device sends per step (`qcollect.wire_bytes` of
        the compiled step); for phased all-reduces, the cheapest phase.
      wire_bytes_max: the costliest phase (equal to ``wire_bytes`` unless
        phased: PowerSGD's uncompressed start; for GradiVeQ its QSGD sampling
        steps and its PCA steps, whichever sends more).
      wire_bytes_by_phase: each phase's bytes per step and device, by the
        names the transformation marks them with
        (`qcollect.wire_bytes_by_phase` of the compiled step: PowerSGD's
        ``exact`` and ``compressed``, GradiVeQ's ``lead-in``, ``sampling``
        and ``compressed``, ``exact`` before ``cfg.compress_after``);
        empty for an all-reduce of one phase.
      phases: the run's schedule, ``[name, start, stop]`` for each run of
        steps ``start .. stop - 1`` in one phase (`Communication.phases`);
        empty for an all-reduce of one phase.
      wire_bytes_by_axis: ``wire_bytes`` split by the mesh axes the
        collectives run over (`qcollect.wire_bytes_by_axis`), keys joined by
        commas: ``{"node": ..., "local": ...}`` for a hierarchical
        all-reduce, ``{"node,local": ...}`` for a psum over both.
      wire_bytes_by_op: ``wire_bytes`` split by collective (``all-gather``,
        ``collective-permute``, ``all-reduce``, ...): under FSDP the
        weights' gather, the gradients' reduce-scatter and the replicated
        leaves' all-reduce.
      memory: bytes one device holds after the run (`DataParallel.memory`).
      step_seconds: median wall time of a step (compiles excluded).
      mean_step_seconds: their mean (the rate of runs whose steps differ:
        DiLoCo's inner steps and its synchronising ones).
      total_seconds: the whole run, compiles and evaluations included.
      compiles: step programs compiled (more than one with entropy plans).
    """

    name: str
    steps: list
    accuracy: list
    losses: list
    wire_bytes: int
    wire_bytes_max: int
    step_seconds: float
    total_seconds: float
    compiles: int = 1
    wire_bytes_by_axis: dict = dataclasses.field(default_factory=dict)
    wire_bytes_by_op: dict = dataclasses.field(default_factory=dict)
    memory: dict = dataclasses.field(default_factory=dict)
    mean_step_seconds: float = float("nan")
    wire_bytes_by_phase: dict = dataclasses.field(default_factory=dict)
    phases: list = dataclasses.field(default_factory=list)

    @property
    def final_accuracy(self) -> float:
        return self.accuracy[-1]


@dataclasses.dataclass(frozen=True)
class InOptimizer:
    """An optimizer that all-reduces inside (`transforms.onebit_adam`):
    `DataParallel.transformation` builds it from the run's compressor in
    place of ``communication -> optimizer``.

    Attributes:
      build: ``build(axis, compressor, key) -> GradientTransformation``.
    """

    build: Callable[..., optax.GradientTransformation]

    def after(self, first: optax.GradientTransformation) -> InOptimizer:
        """This optimizer with ``first`` applied to each device's own
        gradients before it (a clip is then by each device's norm)."""
        return InOptimizer(lambda *args: optax.chain(first, self.build(*args)))


def make_optimizer(cfg, learning_rate: float | optax.Schedule | None = None, *,
                   weight_decay: float = 1e-4) -> optax.GradientTransformation | InOptimizer:
    """The optimizer chained after the all-reduce (AdaGrad by default, as Dryden et al.).

    Args:
      cfg: a `TrainConfig` (``optimizer``, ``learning_rate``).
      learning_rate: a step size or an optax schedule (default ``cfg.learning_rate``).
      weight_decay: AdamW's decoupled weight decay, applied to matrices only
        (kernels, embeddings; not biases or LayerNorm scales): the mask is
        `transforms.matrices`, the rule of the all-reduce's ``compress_if``.

    Example:
      >>> from common.config import TrainConfig
      >>> tx = make_optimizer(TrainConfig(optimizer="adamw"), optax.cosine_decay_schedule(
      ...     1e-3, 100), weight_decay=0.1)
    """
    lr = cfg.learning_rate if learning_rate is None else learning_rate
    if cfg.optimizer == "onebit-adam":
        return InOptimizer(lambda axis, compressor, key: transforms.onebit_adam(
            axis, learning_rate=lr, compress_after=compress_after_of(cfg), key=key,
            compressor=compressor, weight_decay=weight_decay, mask=transforms.matrices(),
            min_size=cfg.min_size))
    if cfg.optimizer == "zero-one-adam":
        return InOptimizer(lambda axis, compressor, key: transforms.zero_one_adam(
            axis, learning_rate=lr, freeze_after=zero_one_schedule(cfg), key=key,
            compressor=compressor, weight_decay=weight_decay, mask=transforms.matrices(),
            min_size=cfg.min_size))
    if cfg.optimizer == "demo":
        return InOptimizer(lambda axis, compressor, key: transforms.decoupled_momentum(
            axis, learning_rate=lr, chunk_size=cfg.demo_chunk, top_k=cfg.demo_top_k,
            beta=cfg.demo_beta, weight_decay=weight_decay, mask=transforms.matrices()))
    if cfg.freeze_variance:
        return transforms.frozen_adamw(lr, cfg.compress_after,
                            weight_decay=weight_decay if cfg.optimizer == "adamw" else 0.0,
                            mask=transforms.matrices())
    return {"adagrad": lambda: optax.adagrad(lr), "sgd": lambda: optax.sgd(lr),
            "momentum": lambda: optax.sgd(lr, momentum=0.9),
            "adam": lambda: optax.adam(lr),
            "adamw": lambda: optax.adamw(lr, weight_decay=weight_decay,
                                         mask=transforms.matrices()),
            }[cfg.optimizer]()


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


class DataParallel:
    """One NNX model, a mesh, and jitted data-parallel steps.

    The loss is the mean cross-entropy of the logits against integer targets
    of the same leading shape: one class per image, or one next byte per
    position of a text window.

    Args:
      model: an ``nnx.Module`` mapping a batch of inputs to logits.
      mesh: the data-parallel mesh (`common.devices.data_mesh`): one axis
        ``"data"`` (default, all devices) or ``("node", "local")``; the
        batch is split over all its axes and the gradients reduced over
        them (``axis``).
    """

    def __init__(self, model: nnx.Module, mesh=None):
        self.mesh = mesh if mesh is not None else jax.make_mesh((jax.device_count(),), (AXIS,))
        names = tuple(self.mesh.axis_names)
        self.axis = names[0] if len(names) == 1 else names
        self.num_devices = self.mesh.size
        self.graphdef, self.params = nnx.split(model)

    def loss(self, params, x, y):
        return cross_entropy(nnx.merge(self.graphdef, params)(x), y)

    def grads(self, params, x, y):
        """Per device (inside the mapped function): loss and gradients."""
        return jax.value_and_grad(self.loss)(params, x, y)

    def manual(self, body, in_specs, out_specs, *, replicated: bool = True):
        """``jit(shard_map(body))`` over the data axes of the mesh.
        ``replicated=False`` turns off shard_map's check that the ``P()``
        outputs are the same on every device (each device keeps its own)."""
        return jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=in_specs,
                                     out_specs=out_specs, check_vma=replicated))

    def shard_map(self, body, state_specs, out_specs, *, replicated: bool = True):
        """`manual` of ``(params, opt_state, x, y)``: params replicated, the
        state by ``state_specs``, the batch split over the data axes."""
        return self.manual(body, (P(), state_specs, P(self.axis), P(self.axis)), out_specs,
                           replicated=replicated)

    def step(self, tx: optax.GradientTransformation, opt_state, *, replicated: bool = True):
        """``step(params, opt_state, x, y) -> (params, opt_state, losses, finite)``.

        ``losses`` has one entry per device and ``finite`` says whether the
        new parameters are finite (they are the same on every device); no
        collective is spent on either, so the step's wire bytes are the
        gradients' alone. ``replicated=False``: ``tx`` does not make the
        update the same on every device (`Communication.replicated`).
        """
        specs = transforms.state_specs(opt_state, self.axis)

        def body(params, opt_state, x, y):
            loss, g = self.grads(lax.pcast(params, self.axis, to="varying"), x, y)
            updates, opt_state = tx.update(g, opt_state, params)
            params = optax.apply_updates(params, updates)
            return params, opt_state, loss[None], all_finite(params)

        return self.shard_map(body, specs, (P(), specs, P(self.axis), P()),
                              replicated=replicated)

    def communication(self, name: str, cfg, key) -> Communication:
        """The gradient all-reduce of compressor ``name`` (`common.compressors`)."""
        return communication(name, cfg, self.axis, key)

    def transformation(self, comm: Communication, optimizer: optax.GradientTransformation
                       | InOptimizer) -> optax.GradientTransformation:
        """The step's transformation: the all-reduce, then the optimizer; an
        `InOptimizer` alone, built from the all-reduce's compressor."""
        if not isinstance(optimizer, InOptimizer):
            return optax.chain(comm.tx, optimizer)
        if comm.compressor is None:
            raise ValueError("this optimizer all-reduces inside and takes the run's compressor: "
                             "the run's all-reduce has none it can take")
        return optimizer.build(self.axis, comm.compressor, comm.key)

    def uncompressed(self) -> DataParallel:
        """The same model and mesh with nothing compressed but the gradients
        (whose compressor each run names): itself."""
        return self

    def place(self, params):
        """The parameters on the mesh: replicated."""
        return self.replicate(params)

    def full(self, params):
        """The whole parameters on every device (for evaluation): as placed."""
        return params

    def memory(self, params, opt_state) -> dict:
        """Bytes held by one device: parameters and optimizer state (its
        error-feedback residuals included)."""
        return {"params": placed_bytes(params), "state": placed_bytes(opt_state)}

    def replicate(self, tree):
        """``tree`` replicated (``P()``) on the mesh, from this process's copy."""
        sharding = NamedSharding(self.mesh, P())
        if jax.process_count() == 1:
            return jax.device_put(tree, sharding)
        def place(leaf):
            host = np.asarray(leaf)
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

        return jax.tree.map(place, tree)

    def init(self, tx: optax.GradientTransformation, params):
        """``tx``'s state placed on the mesh (residuals per device, the rest replicated)."""
        return transforms.init_sharded(tx, params, self.mesh, self.axis)

    def batch(self, x: np.ndarray, y: np.ndarray):
        """A global batch (rows split over the devices) from this process's rows."""
        sharding = NamedSharding(self.mesh, P(self.axis))
        rows = len(x) // jax.process_count()
        lo = jax.process_index() * rows
        return tuple(jax.make_array_from_process_local_data(sharding, a[lo:lo + rows], a.shape)
                     for a in (x, y))

    def accuracy(self, params, x, y, batch: int = 2000) -> float:
        """Test accuracy of the parameters (`full`), on one local device."""
        p = _local(self.full(params))
        hits = sum(int(_hits(self.graphdef, p, x[i:i + batch], y[i:i + batch]))
                   for i in range(0, len(x), batch))
        return hits / max(len(x), 1)

    def mean_loss(self, params, x, y, batch: int = 64) -> float:
        """Mean cross-entropy (nats) of the parameters (`full`) over every
        target of ``y``, on one local device, ``batch`` rows at a time."""
        p = _local(self.full(params))
        total = sum(float(_loss_sum(self.graphdef, p, x[i:i + batch], y[i:i + batch]))
                    for i in range(0, len(x), batch))
        return total / max(y.size, 1)


def all_finite(params) -> jax.Array:
    """Scalar bool: every value of ``params`` is finite (inside the step)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(v)) for v in jax.tree.leaves(params)]))


def on_every_device(tree, mesh, *, mean_of_replicas: bool = False):
    """``tree`` gathered whole onto every device of ``mesh`` (``P()``); with
    ``mean_of_replicas``, the mean over its leading axis of replicas. The
    jitted copy is made once per mesh, not per evaluation."""
    return _gatherer(mesh, mean_of_replicas)(tree)


@functools.cache
def _gatherer(mesh, mean_of_replicas: bool):
    def gather(tree):
        return jax.tree.map(lambda a: a.mean(0), tree) if mean_of_replicas else tree

    return jax.jit(gather, out_shardings=NamedSharding(mesh, P()))


def placed_bytes(tree) -> int:
    """Bytes of ``tree``'s placed arrays held by one device (its first shard of each)."""
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(tree)
               if hasattr(leaf, "addressable_shards"))


def _local(params):
    """This process's first copy of replicated parameters."""
    return jax.tree.map(lambda a: a.addressable_data(0), params)


@jax.jit(static_argnums=0)
def _hits(graphdef, params, x, y):
    return jnp.sum(jnp.argmax(nnx.merge(graphdef, params)(x), -1) == y)


@jax.jit(static_argnums=0)
def _loss_sum(graphdef, params, x, y):
    logits = nnx.merge(graphdef, params)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()


def run_length(cfg, train_size: int, num_devices: int) -> int:
    """Steps per run: ``cfg.steps``, else passes over the data (`TrainConfig.run_length`:
    one; ``cfg.epochs`` for MNIST)."""
    return cfg.run_length(train_size, cfg.batch_size * num_devices)


@dataclasses.dataclass
class _Run:
    """What `train` carries from step to step.

    Attributes:
      params / opt_state: the state after the latest step.
      step: the jitted step in use (the entropy quantizer's planner swaps in
        one per plan).
      planner: the entropy quantizer's `entropy_plan.Planner`, or None.
      first: the first step to run (after a resumed checkpoint's).
      times: wall seconds of each step that did not compile.
      compiled: the steps run so far (one per compile).
      args: ``(params, opt_state, x, y)`` of the latest step, for measuring it.
    """

    params: object
    opt_state: object
    step: object
    planner: entropy_plan.Planner | None
    first: int = 0
    times: list = dataclasses.field(default_factory=list)
    compiled: set = dataclasses.field(default_factory=set)
    args: tuple | None = None


def train(dp: DataParallel, name: str, cfg, data, *, progress=None,
          optimizer: optax.GradientTransformation | None = None) -> RunResult:
    """Trains ``dp``'s model from its initial parameters with compressor ``name``.

    Args:
      dp: the data-parallel model.
      name: a compressor name (`common.compressors`).
      cfg: a `TrainConfig`.
      data: a `common.task.Task`, or an `MNIST` whose images have the model's
        input shape (trained as a `common.task.Classification`).
      progress: ``f(total, desc, initial=)`` returning a tqdm-like bar, or None.
      optimizer: chained after the all-reduce (default `make_optimizer` of ``cfg``).
    """
    start = time.perf_counter()
    task = as_task(data)
    key = jax.random.key(cfg.seed)
    comm: Communication = dp.communication(name, cfg, key)
    optimizer = make_optimizer(cfg) if optimizer is None else optimizer
    run = _start(dp, comm, cfg, key, optimizer)
    total = run_length(cfg, task.train_size, dp.num_devices)
    schedule = comm.phases(total) if comm.phases is not None else ()
    warn_if_never_compressed(name, schedule, total)
    every = cfg.eval_every or max(1, total // 20)
    global_batch = cfg.batch_size * dp.num_devices
    ckpt = Checkpoints(cfg.checkpoint_dir, name, dp.axis) if cfg.checkpoint_dir else None
    save_every = cfg.checkpoint_every or max(1, task.train_size // global_batch)
    if ckpt is not None and cfg.resume and ckpt.latest_step() is not None:
        _resume(run, dp, ckpt)
    result = RunResult(name, [run.first], [task.evaluate(dp, run.params)], [], 0, 0, 0.0, 0.0)
    bar = progress(total, name, initial=run.first) if progress else None
    for i, (x, y) in enumerate(task.batches(global_batch, total, cfg.seed, start=run.first),
                               start=run.first):
        losses = _advance(run, dp, cfg, i, (run.params, run.opt_state) + dp.batch(x, y))
        result.losses.append(float(local_values(losses).mean()))
        if ckpt is not None and ((i + 1) % save_every == 0 or i + 1 == total):
            _save(run, dp, ckpt, i + 1)
        if (i + 1) % every == 0 or i + 1 == total:
            result.steps.append(i + 1)
            result.accuracy.append(task.evaluate(dp, run.params))
        if bar is not None:
            bar.update(1)
            bar.set_postfix({"loss": f"{result.losses[-1]:.3f}",
                             task.metric: f"{result.accuracy[-1]:.4f}"}, refresh=False)
    if bar is not None:
        bar.close()
    if run.args is None:  # resumed at the end: the step is measured, not run
        _measure_only(run, dp, next(task.batches(global_batch, 1, cfg.seed)))
    _measure_wire(result, run.step, run.args, dp.mesh,
                  comm.phased or isinstance(optimizer, InOptimizer))
    result.phases = [list(span) for span in schedule]
    result.memory = dp.memory(run.params, run.opt_state)
    result.compiles = len(run.compiled)
    result.step_seconds = statistics.median(run.times) if run.times else float("nan")
    result.mean_step_seconds = statistics.fmean(run.times) if run.times else float("nan")
    result.total_seconds = time.perf_counter() - start
    return result


def _start(dp: DataParallel, comm: Communication, cfg, key,
           optimizer: optax.GradientTransformation) -> _Run:
    """A run's first state: ``dp``'s parameters placed, the state of the
    transformation ``comm -> optimizer``, its step, and the entropy
    quantizer's planner when ``comm`` has one."""
    tx = dp.transformation(comm, optimizer)
    planner = (entropy_plan.Planner(dp, comm.entropy, cfg, dp.axis, key, optimizer)
               if comm.entropy is not None else None)
    params = dp.place(dp.params)
    opt_state = dp.init(tx, params)
    return _Run(params, opt_state, dp.step(tx, opt_state, replicated=comm.replicated), planner)


def _resume(run: _Run, dp: DataParallel, ckpt: Checkpoints) -> None:
    """``run`` continued from the latest checkpoint of ``ckpt`` (and the entropy
    quantizer's plans saved beside it)."""
    latest = ckpt.latest_step()
    restored = ckpt.restore(latest, {
        "params": run.params, "opt_state": run.opt_state, "step": dp.replicate(np.int32(0))})
    run.params, run.opt_state = restored["params"], restored["opt_state"]
    run.first = step_of(restored)
    saved = ckpt.host_state(latest)
    if run.planner is not None and saved is not None:
        run.step = run.planner.resume(saved, run.opt_state)


def _advance(run: _Run, dp: DataParallel, cfg, i: int, args: tuple):
    """Step ``i`` of ``run`` on ``args`` (``params, opt_state, x, y``): the
    entropy quantizer re-plans every ``cfg.entropy_replan_every`` steps and
    retries a step whose parameters came out non-finite (a payload over its
    plan). Records the step's time unless it compiled; returns the losses
    (one per device)."""
    run.args = args
    planner = run.planner
    if planner is not None and (i % cfg.entropy_replan_every == 0 or planner.plans is None):
        run.step = planner.step(*args)
    fresh = run.step not in run.compiled
    run.compiled.add(run.step)
    t0 = time.perf_counter()
    out = jax.block_until_ready(run.step(*args))
    elapsed = time.perf_counter() - t0
    if planner is not None and not local_values(out[3]).all():
        run.step, out = planner.retry(*args)
        run.compiled.add(run.step)
        fresh = True
    run.params, run.opt_state, losses, _ = out
    if not fresh:
        run.times.append(elapsed)
    return losses


def _save(run: _Run, dp: DataParallel, ckpt: Checkpoints, step: int) -> None:
    """A checkpoint of ``run`` after ``step`` steps (with the planner's plans)."""
    ckpt.save(step, {"params": run.params, "opt_state": run.opt_state,
                     "step": dp.replicate(np.int32(step))},
              run.planner.host_state() if run.planner is not None else None)


def _measure_only(run: _Run, dp: DataParallel, batch) -> None:
    """``run.args`` (and the entropy quantizer's first plan) for a run resumed
    at its last step: the step is measured on ``batch``, not run."""
    run.args = (run.params, run.opt_state) + dp.batch(*batch)
    if run.planner is not None and run.planner.plans is None:
        run.step = run.planner.step(*run.args)


def _measure_wire(result: RunResult, step, args: tuple, mesh, phased: bool) -> None:
    """``result``'s wire bytes, compiled from ``step`` on ``args``: in all, by
    mesh axis, by collective and by phase (a phased all-reduce's cheapest
    phase leads, `RunResult`)."""
    most = qc.wire_bytes(step, *args, branches="max")
    result.wire_bytes = qc.wire_bytes(step, *args, branches="min") if phased else most
    result.wire_bytes_max = most
    branches = "min" if phased else "max"
    result.wire_bytes_by_axis = {
        ",".join(axes) if isinstance(axes, tuple) else axes: count
        for axes, count in qc.wire_bytes_by_axis(step, *args, mesh=mesh,
                                                 branches=branches).items()}
    result.wire_bytes_by_op = {}
    for op in qc.wire_report(step, *args, branches=branches):
        result.wire_bytes_by_op[op.op] = (result.wire_bytes_by_op.get(op.op, 0)
                                          + int(op.bytes_per_call * op.multiplicity))
    result.wire_bytes_by_phase = qc.wire_bytes_by_phase(step, *args) if phased else {}


def warn_if_never_compressed(name: str, schedule, total: int) -> None:
    """A `UserWarning` when a phased all-reduce's schedule has steps but none
    of them compressed: the run ends in its first phases (PowerSGD's
    ``--powersgd-start``, GradiVeQ's lead-in and first sampling steps,
    ``--compress-after``), and its cheapest phase, which the table leads with,
    never ran.

    Example:
      >>> import warnings, transforms
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     warn_if_never_compressed("powersgd",
      ...                              transforms.CompressAfter(1000).spans(300), 300)
      >>> print(caught[0].message)
      powersgd: the run's 300 steps end before its first compressed step (300 exact); ...
    """
    steps = transforms.steps_per_phase(schedule)
    if not steps or steps.get("compressed", 0):
        return
    spent = ", ".join(f"{count} {phase}" for phase, count in steps.items())
    warnings.warn(f"{name}: the run's {total} steps end before its first compressed step "
                  f"({spent}); it sends those phases' bytes every step. Shorten them "
                  "or run longer.", UserWarning, stacklevel=3)


def with_image_shape(data, shape):
    """``data`` with images reshaped to ``(n,) + shape`` (e.g. ``(28, 28, 1)``)."""
    return data._replace(x_train=data.x_train.reshape((-1,) + tuple(shape)),
                         x_test=data.x_test.reshape((-1,) + tuple(shape)))

