"""Every public collective, compressor and transformation lowers for GPU and TPU.

The CPU suite never runs on an accelerator, so a CPU-only path (a branch on
the backend, a primitive without a lowering rule for another platform, a host
callback) would go unnoticed until a GPU or TPU run. Each case here traces one
jitted ``jax.shard_map`` program on a 4-device mesh (abstract
``jax.ShapeDtypeStruct`` arguments, small pytrees whose leaves differ in
shape) and lowers it with ``lowering_platforms=("cuda",)`` and ``("tpu",)``,
which builds the platform's StableHLO without compiling it. The lowered text
must hold a collective and no CPU-only custom call or host callback.

Covered: `qc.compressed_all_reduce` with every compressor of
docs/compressors.md and every algorithm it supports (``"ring"`` for linear
compressors only; PowerSGD's halves as docs/compressors.md runs them, their
payloads on the ring), both exchanges, pipelining, the owner residual and
the hierarchical ``("node", "local")`` form; the ring collectives and their
building blocks;
`qc.compressed_reduce_scatter`, `qc.compressed_all_gather`, `qc.fsdp_gather`
forward and backward; one update of every transformation of `transforms`.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import qcollect as qc
import transforms
from tests.helpers import block, mesh_of, unblock

N = 4
KEY = jax.eval_shape(lambda: jax.random.key(0))   # an abstract PRNG key
PLATFORMS = ("cuda", "tpu")
HIERARCHY = ("node", "local")

#: Two leaves of different shapes and ranks (528 values); a kernel whose
#: matrix view is (32, 16) and a bias.
SHAPES = {"w": (2, 16, 16), "b": (16,)}

#: Custom-call targets and text that only a CPU program holds: LAPACK and
#: DUCC (the CPU's linear algebra and FFT) and host callbacks.
CPU_ONLY = re.compile(r"lapack|ducc|cpu|callback|host", re.IGNORECASE)
COLLECTIVES = ("collective_permute", "all_gather", "all_reduce", "all_to_all",
               "reduce_scatter")


def _hierarchy_mesh():
    return jax.make_mesh((2, 2), HIERARCHY, devices=jax.devices()[:N])


def _mesh(axes):
    return _hierarchy_mesh() if axes == HIERARCHY else mesh_of(N)


def _abstract(shape, spec, mesh, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _abstract_tree(tree):
    """Placed arrays as ``jax.ShapeDtypeStruct``s with their shardings."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        tree)


def _per_device_tree(axes, shapes=None, dtype=jnp.float32):
    """Every device's own pytree, stacked on a leading device axis ``P(axes)``."""
    mesh = _mesh(axes)
    return {name: _abstract((N, *shape), P(axes), mesh, dtype)
            for name, shape in (shapes or SHAPES).items()}


def _per_device(fn, axes, *args):
    """``(jitted, args)``: ``fn(this device's block of x, key)`` under
    ``jax.shard_map``, every output leaf with a leading device axis again."""
    mesh = _mesh(axes)

    def body(x, key):
        return unblock(fn(block(x), key))

    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P()),
                                   out_specs=P(axes)))
    return mapped, args or (_per_device_tree(axes), KEY)


def _orthonormal(rows, cols):
    """A fixed ``(rows, cols)`` matrix with orthonormal columns (a PCA basis, a factor)."""
    rng = np.random.default_rng(1)
    return np.linalg.qr(rng.standard_normal((rows, cols)))[0].astype(np.float32)


@functools.cache
def _compressors():
    """One of every compressor of docs/compressors.md, by readable name."""
    return {
        "identity": qc.identity(),
        "cast_bf16": qc.cast("bfloat16"),
        "cast_f16": qc.cast("float16"),
        "onebit_bucket": qc.onebit(),
        "onebit_column": qc.onebit(grouping="column"),
        "onebit_sampled": qc.onebit(bucket_size=64, sample=16),
        "qsgd4": qc.qsgd(bits=4),
        "qsgd8_l2_nearest": qc.qsgd(bits=8, norm="l2", stochastic=False),
        "threshold": qc.threshold(0.01),
        "threshold_golomb": qc.threshold(0.01, capacity=0.25, coding="golomb_rice"),
        "adaptive_column": qc.adaptive(8),
        "adaptive_bucket_golomb": qc.adaptive(4, grouping="bucket", bucket_size=64,
                                              coding="golomb_rice"),
        "entropy": qc.entropy(),
        "pca": qc.pca(_orthonormal(16, 4), np.full(16, 0.1, np.float32), num_workers=N),
    }


def _all_reduce_cases():
    """``compressor-algorithm`` for every compressor and every algorithm it supports."""
    cases = []
    for name, compressor in _compressors().items():
        for algorithm in qc.ALGORITHMS:
            if algorithm != "ring" or compressor.linear:
                cases.append(f"{name}-{algorithm}")
    return cases


@functools.cache
def _all_reduce_traced(case):
    name, algorithm = case.split("-")
    compressor = _compressors()[name]

    def fn(x, key):
        return qc.compressed_all_reduce(x, "d", compressor, key, algorithm=algorithm, mean=True)

    mapped, args = _per_device(fn, "d")
    return mapped.trace(*args)


def _cpu_only(text):
    """The CPU-only custom-call targets and host-callback markers of StableHLO ``text``."""
    targets = re.findall(r"custom_call @([\w.$-]+)", text)
    targets += re.findall(r'call_target_name = "([^"]*)"', text)
    return {t for t in targets if CPU_ONLY.search(t)} | {
        marker for marker in ("host_callback", "python_cpu_callback") if marker in text}


def _check_lowered(traced, platform):
    """Lowers ``traced`` for ``platform``; asserts a collective and nothing CPU-only."""
    text = traced.lower(lowering_platforms=(platform,)).as_text()
    assert not _cpu_only(text), _cpu_only(text)
    assert any(f"stablehlo.{op}" in text for op in COLLECTIVES), "no collective lowered"


def test_a_cpu_only_program_is_caught():
    """The check's own control: a host callback lowers for the CPU only, and
    the CPU's program names it and LAPACK."""
    def f(x):
        jax.debug.callback(lambda v: None, x)
        return jnp.linalg.qr(x)[0]

    traced = jax.jit(f).trace(jax.ShapeDtypeStruct((8, 8), jnp.float32))
    found = _cpu_only(traced.lower(lowering_platforms=("cpu",)).as_text())
    assert any("callback" in t for t in found) and any("lapack" in t for t in found), found
    for platform in PLATFORMS:
        with pytest.raises(ValueError, match="lowering platform"):
            traced.lower(lowering_platforms=(platform,))


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("case", _all_reduce_cases())
def test_compressed_all_reduce_lowers(case, platform):
    _check_lowered(_all_reduce_traced(case), platform)


def _powersgd_round(x, key):
    """One PowerSGD round as docs/compressors.md#powersgd builds it: each half
    encoded on the matrix, its payloads summed on the compressed-domain ring of
    `qc.identity` (`compressed_all_reduce` cannot cut a matrix into chunks)."""
    del key
    ring = functools.partial(qc.compressed_all_reduce, axis_name="d", compressor=qc.identity(),
                             algorithm="ring")
    right = qc.powersgd(_orthonormal(16, 2))                  # w's matrix view: (32, 16)
    p = ring(right.encode(x["w"])).value
    left = qc.powersgd(qc.orthogonalize(p["p"]), side="left")
    return left.decode(ring(left.encode(x["w"])).value)


def _collective_builders():
    """Name -> ``() -> (jitted, args)`` of the other collectives and variants."""
    onebit, qsgd4 = qc.onebit(), qc.qsgd(bits=4)
    int8 = qc.qsgd(bits=8, bucket_size=2048, stochastic=False)
    builders = {
        "powersgd-round": lambda: _per_device(_powersgd_round, "d"),
        "qsgd4-pairwise-all_to_all": lambda: _per_device(lambda x, k: qc.compressed_all_reduce(
            x, "d", qsgd4, k, exchange="all_to_all"), "d"),
        "pca-ring-all_to_all": lambda: _per_device(lambda x, k: qc.compressed_all_reduce(
            x, "d", _compressors()["pca"], k, exchange="all_to_all"), "d"),
        "entropy_planned-pairwise": lambda: _per_device(lambda x, k: qc.compressed_all_reduce(
            x, "d", qc.entropy(sample_fraction=1.0).with_plan((7, 64)), k), "d"),
        "onebit-pairwise-pipeline2": lambda: _per_device(lambda x, k: qc.compressed_all_reduce(
            x, "d", onebit, k, pipeline=2), "d"),
        "onebit-pairwise-owner_residual": lambda: _per_device(
            lambda x, k: qc.compressed_all_reduce(x, "d", onebit, k, owner_residual=x), "d"),
        "ring_all_reduce": lambda: _per_device(lambda x, k: qc.ring_all_reduce(x, "d"), "d"),
        "ring_reduce_scatter": lambda: _per_device(
            lambda x, k: qc.ring_reduce_scatter(x["w"], "d"), "d"),
        "ring_all_gather": lambda: _per_device(lambda x, k: qc.ring_all_gather(x["w"], "d"), "d"),
        "permute": lambda: _per_device(
            lambda x, k: qc.permute(x, "d", [(i, (i + 1) % N) for i in range(N)]), "d"),
        "all_gather_invariant": lambda: _per_device(
            lambda x, k: qc.all_gather_invariant(x["w"], "d"), "d"),
        "exchange_chunks": lambda: _per_device(
            lambda x, k: qc.exchange_chunks(x, "d"), "d",
            _per_device_tree("d", {"w": (N, 4, 16), "b": (N, 3)}), KEY),
        "fused_psum": lambda: _per_device(lambda x, k: qc.fused_psum(x, "d", mean=True), "d"),
        "bf16_ring_all_reduce": lambda: _per_device(
            lambda x, k: qc.ring_all_reduce(x, "d"), "d",
            _per_device_tree("d", dtype=jnp.bfloat16), KEY),
    }
    for name, c in (("identity", qc.identity()), ("qsgd4", qsgd4), ("onebit", onebit)):
        builders[f"reduce_scatter-{name}"] = functools.partial(_per_device, functools.partial(
            _reduce_scatter, compressor=c, axes="d"), "d")
    builders["reduce_scatter-qsgd4-all_to_all"] = functools.partial(
        _per_device, functools.partial(_reduce_scatter, compressor=qsgd4, axes="d",
                                       exchange="all_to_all"), "d")
    for name, c in (("int8", int8), ("cast_bf16", qc.cast("bfloat16")), ("qsgd4", qsgd4)):
        builders[f"all_gather-{name}"] = functools.partial(_per_device, functools.partial(
            _all_gather, compressor=c, axes="d"), "d")
    return builders


def _reduce_scatter(x, key, *, compressor, axes, exchange="permute"):
    dims = {"w": 1, "b": 0}             # 16 rows each: 4 blocks of 4
    return qc.compressed_reduce_scatter(x, axes, compressor, key, scatter_dimension=dims,
                                        mean=True, exchange=exchange)


def _all_gather(x, key, *, compressor, axes):
    return qc.compressed_all_gather(x, axes, compressor, key, gather_dimension=0)


def _hierarchical_builders():
    """The ``("node", "local")`` forms of the collectives, on a 2 x 2 mesh."""
    builders = {}
    for name, c in (("onebit", qc.onebit()), ("qsgd4", qc.qsgd(bits=4)),
                    ("identity", qc.identity()), ("pca", _compressors()["pca"])):
        builders[f"hierarchical_all_reduce-{name}"] = functools.partial(
            _per_device, functools.partial(_hierarchical_all_reduce, compressor=c), HIERARCHY)
    builders["hierarchical_reduce_scatter-qsgd4"] = functools.partial(
        _per_device, functools.partial(_reduce_scatter, compressor=qc.qsgd(bits=4),
                                       axes=HIERARCHY), HIERARCHY)
    builders["hierarchical_all_gather-int8"] = functools.partial(
        _per_device, functools.partial(
            _all_gather, compressor=qc.qsgd(bits=8, bucket_size=2048, stochastic=False),
            axes=HIERARCHY), HIERARCHY)
    builders["hierarchical_fsdp_gather-backward"] = functools.partial(
        _fsdp_gather_case, HIERARCHY, backward=True)
    return builders


def _hierarchical_all_reduce(x, key, *, compressor):
    return qc.compressed_all_reduce(x, HIERARCHY, compressor, key, mean=True)


FSDP_SHAPES = {"w": (32, 16), "k": (12, 16), "b": (16,)}
FSDP_DIMS = {"w": 0, "k": 1, "b": None}


def _fsdp_gather_case(axes, *, backward):
    """``qc.fsdp_gather`` of shards with int8 weights and 4-bit gradients: the
    gathered parameters, or (``backward``) ``jax.grad`` of a loss through it."""
    mesh = _mesh(axes)
    specs = {name: P(*[axes if i == d else None for i in range(len(shape))])
             for (name, shape), d in zip(FSDP_SHAPES.items(), FSDP_DIMS.values(), strict=True)}
    shards = {name: _abstract(shape, specs[name], mesh) for name, shape in FSDP_SHAPES.items()}
    residuals = {name: _abstract((N, *shape) if FSDP_DIMS[name] is not None else (N,), P(axes),
                                 mesh) for name, shape in FSDP_SHAPES.items()}
    gather = functools.partial(
        qc.fsdp_gather, axis_name=axes, dimension=FSDP_DIMS, gradients=qc.qsgd(bits=4),
        weights=qc.qsgd(bits=8, bucket_size=2048, stochastic=False))

    def loss(s, r, key):
        p = gather(s, r, key)
        return jnp.sum(jnp.tanh(p["w"] @ p["k"].T) ** 2) + jnp.sum(p["b"] ** 2)

    def body(s, r, key):
        r = block(r)
        if backward:
            return unblock(jax.grad(loss, argnums=(0, 1))(s, r, key))
        return unblock(gather(s, r, key))

    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P(axes), P()),
                                   out_specs=P(axes)))
    return mapped, (shards, residuals, KEY)


def _other_builders():
    builders = {**_collective_builders(), **_hierarchical_builders()}
    builders["fsdp_gather-forward"] = functools.partial(_fsdp_gather_case, "d", backward=False)
    builders["fsdp_gather-backward"] = functools.partial(_fsdp_gather_case, "d", backward=True)
    return builders


def _params(axes):
    """The replicated parameters ``P()``, abstract."""
    return {name: _abstract(shape, P(), _mesh(axes)) for name, shape in SHAPES.items()}


def _placed_state(tx, params, axes):
    """``transforms.init_sharded``'s layout, abstract: per-device leaves (by
    `transforms.state_specs`) get a leading device axis, the rest stay as they are."""
    mesh = _mesh(axes)
    state = jax.eval_shape(tx.init, params)
    specs = transforms.state_specs(state, axes)
    return jax.tree.map(lambda a, spec: _abstract(a.shape if spec == P() else (N, *a.shape),
                                                  spec, mesh, a.dtype), state, specs), specs


def _loss(p, x):
    h = jnp.tanh(jnp.einsum("ri,kij->rkj", x, p["w"]) + p["b"])   # x: (rows, 16)
    return jnp.mean(h ** 2)


def _data(axes):
    return _abstract((N, 2, 16), P(axes), _mesh(axes))


def _data_parallel(tx, axes="d"):
    """The data-parallel step of docs/transforms.md: params ``P()``, the state
    by `transforms.state_specs`, gradients at ``lax.pcast(params, to="varying")``."""
    params = _params(axes)
    state, specs = _placed_state(tx, params, axes)

    def body(params, state, x):
        grads = jax.grad(_loss)(lax.pcast(params, axes, to="varying"), x[0])
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(body, mesh=_mesh(axes), in_specs=(P(), specs, P(axes)),
                                 out_specs=(P(), specs)))
    return step, (params, state, _data(axes))


def _local_replicas(tx, *, stacked_state):
    """The step of model averaging and DiLoCo: one replica per device,
    ``P("d")``; the state stacked likewise, or (DiLoCo) placed by its specs."""
    mesh = mesh_of(N)
    params = {name: _abstract((N, *shape), P("d"), mesh) for name, shape in SHAPES.items()}
    one = {name: jax.ShapeDtypeStruct(shape, jnp.float32) for name, shape in SHAPES.items()}
    if stacked_state:
        state = jax.tree.map(lambda a: _abstract((N, *a.shape), P("d"), mesh, a.dtype),
                             jax.eval_shape(tx.init, one))
        specs = P("d")
    else:
        state, specs = _placed_state(tx, _params("d"), "d")

    def body(replicas, state, x):
        p = transforms.local_replica(replicas, "d")
        s = transforms.local_replica(state, "d") if stacked_state else state
        updates, s = tx.update(jax.grad(_loss)(p, x[0]), s, p)
        s = unblock(s) if stacked_state else s
        return unblock(optax.apply_updates(p, updates)), s

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), specs, P("d")),
                                 out_specs=(P("d"), specs)))
    return step, (params, state, _data("d"))


def _fsdp_step():
    """The FSDP step of docs/transforms.md with the sharded clip and finite guard."""
    mesh, dims = mesh_of(N), {"w": 1, "b": None}
    params = {name: jnp.zeros(shape) for name, shape in SHAPES.items()}
    fsdp = transforms.fsdp("d", dimension=dims, key=jax.random.key(0), gradients=qc.qsgd(bits=4),
                           weights=qc.qsgd(bits=8, bucket_size=2048, stochastic=False))
    tx = optax.chain(transforms.clip_by_global_norm(1.0, "d"),
                     transforms.apply_if_finite(optax.adamw(1e-3), "d", max_consecutive_errors=3))
    shards = transforms.shard_params(params, mesh, "d", dims)
    opt_state = transforms.init_on_shards(tx, shards, mesh)
    fsdp_state = transforms.init_sharded(fsdp, params, mesh, "d")
    specs = (transforms.shard_specs(dims, "d"), transforms.state_specs(fsdp_state, "d"),
             transforms.sharded_specs(opt_state))

    def body(shards, fsdp_state, opt_state, x):
        (_, grads), fsdp_state = fsdp.value_and_grad(_loss)(shards, fsdp_state, x[0])
        updates, opt_state = tx.update(grads, opt_state, shards)
        return optax.apply_updates(shards, updates), fsdp_state, opt_state

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(*specs, P("d")), out_specs=specs))
    return step, (*_abstract_tree((shards, fsdp_state, opt_state)), _data("d"))


def _transform_builders():
    """Name -> ``() -> (jitted step, abstract args)``: one update of every transformation."""
    key = jax.random.key(0)
    all_reduce = functools.partial(transforms.compressed_all_reduce, key=key, min_size=100)
    onebit = qc.onebit()
    return {
        "compressed_all_reduce-qsgd4-adam": lambda: _data_parallel(optax.chain(
            all_reduce("d", compressor=qc.qsgd(bits=4)), optax.adam(1e-3))),
        "compressed_all_reduce-onebit-pairwise-mask_zero_rows": lambda: _data_parallel(
            all_reduce("d", compressor=onebit, algorithm="pairwise", mask_zero_rows=True)),
        "compressed_all_reduce-onebit-ef21-momentum": lambda: _data_parallel(
            all_reduce("d", compressor=onebit, error_feedback=transforms.ef21(momentum=0.9))),
        "compressed_all_reduce-warm_up-frozen_adamw": lambda: _data_parallel(optax.chain(
            all_reduce("d", compressor=onebit, compress_after=2), optax.clip_by_global_norm(1.0),
            transforms.frozen_adamw(1e-3, freeze_after=2))),
        "compressed_all_reduce-hierarchical": lambda: _data_parallel(
            all_reduce(HIERARCHY, compressor=onebit), HIERARCHY),
        "mean_all_reduce": lambda: _data_parallel(transforms.mean_all_reduce("d")),
        "powersgd": lambda: _data_parallel(transforms.powersgd("d", rank=2, key=key,
                                                                compress_after=1)),
        "gradiveq": lambda: _data_parallel(transforms.gradiveq(
            "d", key=key, slice_size=16, rank=2, warmup_steps=1, sample_steps=1,
            compressed_steps=1)),
        "accumulate": lambda: _data_parallel(transforms.accumulate("d", every=2, inner=optax.chain(
            all_reduce("d", compressor=onebit), optax.sgd(0.1)))),
        "compressed_model_averaging": lambda: _local_replicas(optax.chain(
            optax.sgd(0.1), transforms.compressed_model_averaging("d", every_k=2, key=key,
                                                                   min_size=100)),
            stacked_state=True),
        "diloco": lambda: _local_replicas(transforms.diloco(
            "d", inner=optax.adamw(1e-3), every=2, reduce=all_reduce(
                "d", compressor=qc.qsgd(bits=4))), stacked_state=False),
        "fsdp-clip_by_global_norm-apply_if_finite": _fsdp_step,
    }


@functools.cache
def _traced(kind, case):
    """The traced program of builder ``case`` of ``kind`` (once for both platforms)."""
    fn, args = {"collective": _other_builders, "transform": _transform_builders}[kind]()[case]()
    return fn.trace(*args)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("case", sorted(_other_builders()))
def test_collective_lowers(case, platform):
    _check_lowered(_traced("collective", case), platform)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("case", sorted(_transform_builders()))
def test_transform_update_lowers(case, platform):
    _check_lowered(_traced("transform", case), platform)
