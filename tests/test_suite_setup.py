"""The suite's own compile setting (`tests/conftest.py`): XLA:CPU's backend at
optimisation level 0 changes how fast a program compiles, not the optimised
HLO that the tests read."""

import hashlib
import os
import subprocess
import sys

#: A 4-bit compressed all-reduce with exact steps first and Adam, on 8 devices:
#: prints a hash of the optimised HLO, its wire bytes and those of each phase.
PROGRAM = """
import functools, hashlib, jax, jax.numpy as jnp, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import qcollect as qc, transforms

mesh = jax.make_mesh((8,), ("data",))
params = {"w": jnp.ones((64, 128)), "b": jnp.zeros(128)}
tx = optax.chain(transforms.compressed_all_reduce(
    "data", compressor=qc.qsgd(bits=4), key=jax.random.key(0),
    compress_after=transforms.CompressAfter(3)), optax.adam(1e-2))
state = transforms.init_sharded(tx, params, mesh, "data")
specs = transforms.state_specs(state, "data")


@jax.jit
@functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), specs, P("data")),
                   out_specs=(P(), specs))
def step(p, s, g):
    grads = jax.tree.map(lambda x: x * g.sum(), jax.lax.pcast(p, "data", to="varying"))
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s


g = jax.device_put(jnp.ones(8), NamedSharding(mesh, P("data")))
text = " ".join(step.lower(params, state, g).compile().as_text().split())
print(hashlib.sha1(text.encode()).hexdigest(), len(text), qc.wire_bytes(step, params, state, g),
      sorted(qc.wire_bytes_by_phase(step, params, state, g).items()))
"""


def _compiled_at(level: int, tmp_path) -> str:
    script = tmp_path / "program.py"  # one name: the HLO's metadata holds it
    script.write_text(PROGRAM)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
        f"--xla_force_host_platform_device_count=8 --xla_backend_optimization_level={level}"))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         env=env, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]


def test_the_suites_compile_level_is_set():
    assert "--xla_backend_optimization_level=" in os.environ["XLA_FLAGS"]


def test_level_zero_compiles_the_same_optimised_hlo_as_the_default(tmp_path):
    """The same program at level 0 (the suite's) and 2 (XLA:CPU's default):
    the same optimised HLO text, hence the same collectives, bytes and phase
    marks; only LLVM's code generation below it differs."""
    fast, default = _compiled_at(0, tmp_path), _compiled_at(2, tmp_path)
    digest, size, total, phases = fast.split(" ", 3)
    assert len(digest) == len(hashlib.sha1().hexdigest()) and int(size) > 10_000
    assert int(total) > 0 and "'compressed'" in phases and "'exact'" in phases
    assert fast == default, (fast, default)
