"""A small GPT: a decoder-only transformer over bytes (Radford et al. 2019, GPT-2).

Token and learned position embeddings, ``depth`` pre-LayerNorm blocks of
causal multi-head self-attention and a 4x MLP (GELU), a final LayerNorm and
a linear head over the 256 byte values, tied to the token embedding by
default. Every weight is a 2-D matrix: the attention's query, key and value
projections are one ``nnx.Linear`` of ``width -> 3 width`` (not
``nnx.MultiHeadAttention``, whose ``LinearGeneral`` kernels are 3-D), so
PowerSGD and GradiVeQ see the matrices the layers multiply by; what is not a
matrix (biases, LayerNorm scales) is a vector of at most ``4 width`` values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

VOCAB = 256  # bytes
_INIT = nnx.initializers.normal(0.02)


class Block(nnx.Module):
    """``x + attention(LN(x))``, then ``x + MLP(LN(x))``.

    The output projections start at ``0.02 / sqrt(2 depth)`` (GPT-2, section
    2.3) so that the residual stream's variance does not grow with depth.
    """

    def __init__(self, width: int, heads: int, depth: int, *, rngs: nnx.Rngs):
        out_init = nnx.initializers.normal(0.02 / (2 * depth) ** 0.5)
        self.heads = heads
        self.ln1 = nnx.LayerNorm(width, rngs=rngs)
        self.qkv = nnx.Linear(width, 3 * width, kernel_init=_INIT, rngs=rngs)
        self.proj = nnx.Linear(width, width, kernel_init=out_init, rngs=rngs)
        self.ln2 = nnx.LayerNorm(width, rngs=rngs)
        self.up = nnx.Linear(width, 4 * width, kernel_init=_INIT, rngs=rngs)
        self.down = nnx.Linear(4 * width, width, kernel_init=out_init, rngs=rngs)

    def attention(self, x):
        """Causal self-attention of ``x`` ``(batch, time, width)``."""
        b, t, w = x.shape
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * self.heads, w // self.heads), 3, axis=2)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.reshape(b, t, w))

    def __call__(self, x):
        x = x + self.attention(self.ln1(x))
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
    """Bytes ``(batch, time)`` (``time <= context``) to next-byte logits ``(batch, time, 256)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> model = GPT(width=32, depth=2, heads=4, context=16, rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((2, 16), jnp.int32)).shape
      (2, 16, 256)
    """

    def __init__(self, *, width: int, depth: int, heads: int, context: int,
                 tie_embeddings: bool = True, rngs: nnx.Rngs):
        if width % heads:
            raise ValueError(f"width ({width}) must be a multiple of heads ({heads})")
        self.tokens = nnx.Embed(VOCAB, width, embedding_init=_INIT, rngs=rngs)
        self.positions = nnx.Embed(context, width, embedding_init=_INIT, rngs=rngs)
        self.blocks = nnx.List([Block(width, heads, depth, rngs=rngs) for _ in range(depth)])
        self.ln = nnx.LayerNorm(width, rngs=rngs)
        self.head = (None if tie_embeddings else
                     nnx.Linear(width, VOCAB, use_bias=False, kernel_init=_INIT, rngs=rngs))

    @staticmethod
    def tensor_parallel(names: tuple) -> str | None:
        """Megatron-LM's split over a model axis (Shoeybi et al. 2019, section
        3; `common.model_axes`): the attention's ``qkv`` and the MLP's ``up``
        are column layers, ``proj`` and ``down`` row layers; embeddings and
        LayerNorms are replicated. ``names``: a layer's path names, e.g.
        ``("blocks", 0, "up")``.

        Example:
          >>> GPT.tensor_parallel(("blocks", 1, "down")), GPT.tensor_parallel(("ln",))
          ('row', None)
        """
        return {"qkv": "column", "up": "column", "proj": "row", "down": "row"}.get(
            names[-1] if names else None)

    def __call__(self, x):
        h = self.tokens(x) + self.positions(jnp.arange(x.shape[-1]))
        for block in self.blocks:
            h = block(h)
        h = self.ln(h)
        return self.tokens.attend(h) if self.head is None else self.head(h)


def build(cfg) -> GPT:
    """The model of ``cfg`` (same initialisation for every compressor: ``cfg.seed``)."""
    return GPT(width=cfg.width, depth=cfg.depth, heads=cfg.heads, context=cfg.context,
               tie_embeddings=cfg.tie_embeddings, rngs=nnx.Rngs(cfg.seed))
