"""The network of Dryden et al. (section 4): fully connected ReLU layers, softmax output."""

from __future__ import annotations

from flax import nnx


class MLP(nnx.Module):
    """``784 -> width x depth (ReLU) -> 10`` logits.

    Dryden et al. use three hidden layers of 4096; the default here is
    narrower so that eight simulated devices train it on a 2-core CPU.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> MLP(width=32, depth=3, rngs=nnx.Rngs(0))(jnp.zeros((2, 784))).shape
      (2, 10)
    """

    def __init__(self, *, width: int, depth: int = 3, inputs: int = 784, classes: int = 10,
                 rngs: nnx.Rngs):
        sizes = [inputs] + [width] * depth
        self.hidden = nnx.List([nnx.Linear(a, b, rngs=rngs)
                                for a, b in zip(sizes[:-1], sizes[1:], strict=True)])
        self.out = nnx.Linear(sizes[-1], classes, rngs=rngs)

    def tensor_parallel(self, names: tuple) -> str | None:
        """The layers' split over a model axis (Megatron-LM's MLP, Shoeybi et
        al. 2019, section 3; `common.model_axes`): column and row layers in
        turn, so that each row layer sums what the column layer before it
        split. ``names``: a layer's path names, ``("hidden", i)`` or ``("out",)``.

        Example:
          >>> mlp = MLP(width=32, depth=3, rngs=nnx.Rngs(0))
          >>> [mlp.tensor_parallel(("hidden", i)) for i in range(3)], mlp.tensor_parallel(("out",))
          (['column', 'row', 'column'], 'row')
        """
        index = names[1] if names[:1] == ("hidden",) else len(self.hidden)
        return "column" if index % 2 == 0 else "row"

    def __call__(self, x):
        for layer in self.hidden:
            x = nnx.relu(layer(x))
        return self.out(x)


def build(cfg) -> MLP:
    """The model of ``cfg`` (same initialisation for every compressor: ``cfg.seed``)."""
    return MLP(width=cfg.width, depth=cfg.depth, rngs=nnx.Rngs(cfg.seed))
