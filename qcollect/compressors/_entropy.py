"""Entropy-driven bit-width quantization with Huffman coding.

Oland and Raj, "Reducing Communication Overhead in Distributed Learning by an
Order of Magnitude (Almost)", sections 3.1-3.4 and 4, Algorithms 1 and 2.

Payload arrays (exactly what travels):

* ``range``: float32 ``[w_min, w_max]``.
* ``bits``: uint32 ``[N]``.
* ``lengths`` (huffman): 4-bit code lengths of the ``2**B`` symbols,
  8 per uint32, ``B`` the planned ``N`` or ``ceiling``.
* ``blocks`` (huffman): uint32 start bit of every ``block_size`` values
  (not in the paper), so decode runs ``ceil(n / block_size)`` decoders
  in lockstep, one `lax.scan` step per value of a block, instead of
  one step per value. Costs ``32 / block_size`` bits per value (0.03
  at 1024); ``block_size=None`` sends one block (the paper's stream).
* ``stream``: the codes, MSB-first in uint32 words; fixed ``N``-bit
  codes when ``huffman=False``.

So ``payload_bytes`` is ``12 + 4 * words`` raw, and with Huffman
``12 + 4 * ceil(2**B / 8) + 4 * ceil(n / block_size) + 4 * words``. The
code lengths cost ``2**(B+2) / n`` bits per value: negligible for large
arrays, several bits per value below a few thousand values.

Static shapes: ``N`` and the Huffman stream length depend on the data.

* Without a plan, ``encode`` sizes for the worst case: ``2**ceiling``
  code lengths and ``ceil(n * ceiling / 32)`` stream words. Overflow is
  impossible: the code is optimal among prefix codes of length <= 15 and
  the fixed ``N``-bit code is one of them (``N <= ceiling <= 15``), so
  the stream never exceeds ``n * N`` bits.
* ``c.plan(x, key)`` (cheap, jittable) returns the exact ``N`` and word
  count; ``c.encode(x, key, plan=plan)`` or ``c.with_plan(plan).encode``
  then sends exactly that many words and ``2**N`` lengths, skipping the
  entropy estimate. The plan must be Python ints (static); cache one
  compiled step per plan, e.g.
  ``jax.jit(c.encode, static_argnames="plan")``. A planned payload is
  the unplanned one with its arrays cut to the planned sizes; its wire
  format names the plan (``.../plan/b7/w100``), so every entropy
  compressor of the same settings decodes it and checks those sizes
  exactly. A plan belongs to the compressor and data it was made for; on
  other data (or a Huffman plan given to a raw compressor) it may be too
  small: the stream is then cut and ``range`` is set to NaN, so decode
  returns all-NaN, never a silently wrong value. Plan-based encode vmaps
  with one plan for the whole batch (e.g. the largest of a vmapped
  ``plan``).

Decoding a Huffman stream is sequential within a block (decode times in
docs/compressors.md#entropy-payload-and-plans).

Groups: the whole array is one group (Oland & Raj code each weight
matrix on its own). In `qcollect.compressed_all_reduce` a leaf is never
fused with another; each device codes its equal share of the leaf with
its own range, bit-width and Huffman code (``valid``, one count, keeps
the zero padding of the last share out of the range and the entropy
sample; padding values are still coded, clipped into the range).

Non-finite inputs make ``w_min``/``w_max`` non-finite, so every decoded
value is non-finite. Arrays of fewer than 2**32 / 15 values (bit offsets
are uint32). The entropy sample is drawn with replacement from a
counter-based hash of ``key`` (the paper: "a random subset").
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from qcollect._config import require_key
from qcollect._payload import Compressor, Payload, check_format
from qcollect.checks import check_float, check_int
from qcollect.coding import _huffman as hf
from qcollect.coding._packing import pack_bits, packed_words, unpack_bits
from qcollect.compressors._entropy_stats import (
    MAX_BITS,
    ROUND_TOL,
    entropy_bits,
    extremes,
    flat_values,
    quantize,
    real_count,
    sample_indices,
)

__all__ = ["EntropyCodec", "EntropyCompressor", "EntropyPlan", "PlannedEntropyCompressor",
           "entropy"]

_SETTINGS = ("sample_fraction", "prelim_bits", "floor", "ceiling", "huffman", "block_size")


class EntropyPlan(NamedTuple):
    """Static sizes of one encoding: the bit-width and the stream length.

    Attributes:
      bits: the bit-width ``N`` (Algorithm 1, line 5).
      words: uint32 words of the code stream.

    `EntropyCompressor.plan` returns int32 arrays (it runs under jit); turn
    them into Python ints on the host with ``jax.tree.map(int, plan)``.
    """

    bits: int
    words: int


@dataclasses.dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class _EntropySettings(Compressor):
    """An entropy compressor's settings as typed fields, and its codec.

    Attributes:
      sample_fraction: ``F``, the fraction of values in the entropy sample.
      prelim_bits: ``M``, bits of the preliminary quantizer.
      floor: ``c``, the floor on the bit-width.
      ceiling: the cap on the bit-width ``N``.
      huffman: whether the values are Huffman coded.
      block_size: values per decodable block, or None for one block.
      codec: the `EntropyCodec` behind ``encode`` and ``decode`` (not a setting).
    """

    sample_fraction: float
    prelim_bits: int
    floor: int
    ceiling: int
    huffman: bool
    block_size: int | None
    codec: EntropyCodec

    setting_names: ClassVar[tuple[str, ...]] = _SETTINGS


@dataclasses.dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class EntropyCompressor(_EntropySettings):
    """What `entropy` returns: a `Compressor` with the plan step of the entropy quantizer.

    Its settings are typed fields (``sample_fraction``, ``prelim_bits``,
    ``floor``, ``ceiling``, ``huffman``, ``block_size``), and its
    ``encode(x, key=None, *, plan=None, valid=None)`` also takes a static plan.

    Methods:
      plan(x, key=None, *, valid=None) -> EntropyPlan of int32 arrays;
        jittable and vmappable.
      with_plan(plan) -> `PlannedEntropyCompressor` whose encode uses the
        plan's static sizes (deterministic; the same plan returns the same,
        cached, object). The plan is one of its settings, an `EntropyPlan`
        of Python ints, so planned compressors are equal when their settings
        and plans are, and each plan is its own static `jax.jit` argument.
    """

    def plan(self, x: jax.Array, key: jax.Array | None = None, *,
             valid: jax.Array | None = None) -> EntropyPlan:
        """The exact sizes an encoding of ``x`` needs (Algorithm 1, lines 3-9).

        Runs the analysis of ``encode`` (range, entropy sample, bit-width,
        Huffman code) without writing the stream. Jittable and vmappable.

        Args:
          x: the floating-point array to be encoded.
          key: the PRNG key ``encode`` will get (needed when
            ``sample_fraction < 1``).
          valid: one int32 count: the real values of ``x`` (the rest is
            padding), as ``encode`` takes it.

        Returns:
          An `EntropyPlan` of int32 scalars; ``jax.tree.map(int, plan)``
          turns it into the static ints `with_plan` takes.
        """
        return self.codec.plan(x, key, valid=valid)

    def with_plan(self, plan: EntropyPlan | tuple[int, int]) -> PlannedEntropyCompressor:
        """The compressor whose payloads have exactly ``plan``'s sizes.

        Args:
          plan: ``(bits, words)`` as concrete ints, ``bits`` in
            ``[floor, ceiling]``.

        Returns:
          A `PlannedEntropyCompressor`, the same object for the same plan.

        Raises:
          ValueError: ``plan`` is not two concrete ints in range.
        """
        return self.codec.with_plan(plan)


@dataclasses.dataclass(frozen=True, eq=False, repr=False, kw_only=True)
class PlannedEntropyCompressor(_EntropySettings):
    """An entropy compressor bound to one static plan (`EntropyCompressor.with_plan`).

    Attributes:
      plan: the `EntropyPlan` of Python ints its payloads are sized for; its
        last setting.
    """

    plan: EntropyPlan

    setting_names: ClassVar[tuple[str, ...]] = _SETTINGS + ("plan",)


def entropy(*, sample_fraction: float = 0.03, prelim_bits: int = 4, floor: int = 6,
            ceiling: int = 10, huffman: bool = True,
            block_size: int | None = 1024) -> EntropyCompressor:
    """Oland & Raj: ``N = H + c`` bits per value, min-max bins, Huffman coded.

    Encoding (Algorithm 1) of an array ``W`` of ``n`` values:

    1. ``w_min, w_max``: the extremes of ``W`` (line 3).
    2. ``H``: the entropy (bits) of a preliminary ``M``-bit quantization
       (``M = prelim_bits``) of ``ceil(F n)`` values (``F = sample_fraction``)
       drawn at random, with replacement (line 4; section 3.4).
    3. ``N = min(ceil(H + c - 1e-4), ceiling)`` with ``c = floor`` (line 5).
       Rounding up keeps at least the ``H + c`` bits the formula asks for and
       makes ``c`` a true floor; the 1e-4 absorbs float32 error in ``H``.
    4. ``q = min(floor(2**N (w - w_min) / (w_max - w_min)), 2**N - 1)``
       (line 6; ``q = 0`` when ``w_max == w_min``). The paper prints
       ``w_max - w`` in QUANTIZE, which would mirror the bins against the
       decoder's ``w_min + ...``; we use ``w - w_min`` so that Algorithm 2
       returns each value's own bin centre.
    5. Huffman code of the histogram of ``q`` (lines 7-9): optimal canonical
       code with lengths at most 15 (package-merge), sent as one 4-bit length
       per symbol instead of the probabilities ``P`` (line 10); the
       canonical code is rebuilt from the lengths (Algorithm 2, line 2).

    Decoding (Algorithm 2) needs only the payload:
    ``w_min + (w_max - w_min) (q + 0.5) / 2**N``. The payload arrays, their
    sizes, and how a plan (``c.plan``, then ``c.with_plan``) replaces the
    worst-case sizes of the unplanned encode are in
    docs/compressors.md#entropy-payload-and-plans.

    Args:
      sample_fraction: ``F`` in (0, 1]; at 1 every value is used once and no
        key is needed.
      prelim_bits: ``M`` in [1, 15], bits of the preliminary quantizer.
      floor: ``c`` in [1, 15], the floor on the bit-width.
      ceiling: in [floor, 15], the cap on ``N`` (paper: 10, section 5.1).
      huffman: Huffman-code the values (True) or send raw ``N``-bit codes.
      block_size: values per independently decodable block, >= 1, or None
        for a single block.

    Returns:
      An `EntropyCompressor`: a `Compressor` (stochastic when ``F < 1``, not
      linear) with ``plan`` and ``with_plan``.

    Raises:
      ValueError: a setting outside the values above.

    References:
      Oland, Raj, "Reducing Communication Overhead in Distributed Learning
      by an Order of Magnitude (Almost)", ICASSP 2015, pp. 2219-2223 (no
      open version found), Algorithms 1 and 2;
      F = 0.03, M = 4, c = 5 or 6 and a ceiling of 10 are the paper's
      settings (sections 4, 5.1).

    Example:
      >>> import jax, jax.numpy as jnp, qcollect as qc
      >>> c = qc.entropy(sample_fraction=1.0)
      >>> x = jnp.linspace(-1.0, 1.0, 1000)
      >>> plan = jax.tree.map(int, c.plan(x))
      >>> plan
      EntropyPlan(bits=10, words=312)
      >>> y = c.decode(c.encode(x, plan=plan))
      >>> bool(jnp.max(jnp.abs(y - x)) <= 1 / 1024)
      True
    """
    sample_fraction = check_float("sample_fraction", sample_fraction, low=0.0, high=1.0)
    prelim_bits = check_int("prelim_bits", prelim_bits, low=1, high=MAX_BITS)
    floor = check_int("floor", floor, low=1, high=MAX_BITS)
    ceiling = check_int("ceiling", ceiling, low=floor, high=MAX_BITS)
    if not isinstance(huffman, bool):
        raise ValueError(f"huffman must be True or False, got {huffman!r}")
    block_size = check_int("block_size", block_size, low=1, allow_none=True)
    codec = EntropyCodec(sample_fraction, prelim_bits, floor, ceiling, huffman, block_size)
    return EntropyCompressor(codec.name, codec.encode, codec.decode, linear=False,
                             stochastic=codec.stochastic, grouping="leaf", masks_padding=True,
                             variant=codec.variant, codec=codec, **codec.settings())


class EntropyCodec:
    """The entropy quantizer of one set of settings: plan, encode, decode.

    Every compressor it makes (the unplanned one and one per plan) holds it
    as ``codec`` and encodes and decodes through it.
    """

    def __init__(self, fraction: float, prelim: int, floor: int, ceiling: int, huffman: bool,
                 block: int | None) -> None:
        self.fraction, self.prelim, self.floor = fraction, prelim, floor
        self.ceiling, self.huffman, self.block = ceiling, huffman, block
        self.stochastic = fraction < 1.0
        self.name = (f"entropy/F{fraction:g}/M{prelim}/c{floor}/max{ceiling}/"
                     + (f"huffman/{block or 'whole'}" if huffman else "raw"))
        self._planned = functools.lru_cache(maxsize=64)(self._make_planned)

    def settings(self) -> dict[str, Any]:
        """The entropy compressor's settings, by name."""
        values = (self.fraction, self.prelim, self.floor, self.ceiling, self.huffman, self.block)
        return dict(zip(_SETTINGS, values, strict=True))

    def with_plan(self, plan: EntropyPlan | tuple[int, int]) -> PlannedEntropyCompressor:
        """The compressor for one plan; the same plan returns the same object."""
        try:
            bits, words = (int(v) for v in plan)
        except (TypeError, ValueError, jax.errors.ConcretizationTypeError) as err:
            raise ValueError(f"plan must be two concrete ints (bits, words), got {plan!r}") from err
        check_int("plan.bits", bits, low=self.floor, high=self.ceiling)
        check_int("plan.words", words, low=0)
        return self._planned(bits, words)

    def plan_format(self, bits: int, words: int) -> str:
        """The wire format of payloads encoded with plan ``(bits, words)``:
        the plan's sizes are static metadata, so decoding checks them."""
        return f"{self.name}/plan/b{bits}/w{words}"

    def variant(self, fmt: str) -> Compressor | None:
        """The planned compressor whose payloads have format ``fmt``, or None."""
        prefix = f"{self.name}/plan/b"
        if not fmt.startswith(prefix):
            return None
        bits, _, words = fmt[len(prefix):].partition("/w")
        if not (bits.isdigit() and words.isdigit()):
            return None
        return self.with_plan((int(bits), int(words)))

    def _block(self, n: int) -> int:
        return self.block or max(n, 1)

    # -- analysis shared by plan and encode ---------------------------------
    def _bits(self, flat: jax.Array, w_min: jax.Array, w_max: jax.Array,
              key: jax.Array | None, real: jax.Array | None = None) -> jax.Array:
        """Algorithm 1, lines 4-5: ``N = clip(ceil(H + c))``, int32 scalar."""
        if self.stochastic:
            require_key(key, "entropy(sample_fraction < 1)")
        picks = flat[sample_indices(key, flat.shape[0], self.fraction, real)]
        h = entropy_bits(quantize(picks, w_min, w_max, self.prelim), 2**self.prelim)
        n_bits = jnp.ceil(h + (self.floor - ROUND_TOL)).astype(jnp.int32)
        return jnp.clip(n_bits, self.floor, self.ceiling)

    def _codebook(self, q: jax.Array, symbols: int) -> tuple[jax.Array, jax.Array]:
        lengths = hf.code_lengths(jnp.bincount(q, length=symbols))
        return lengths, hf.canonical_codes(lengths)

    def plan(self, x: jax.Array, key: jax.Array | None = None, *,
             valid: jax.Array | None = None) -> EntropyPlan:
        """`EntropyCompressor.plan`."""
        flat = flat_values(x)
        real = real_count(valid)
        w_min, w_max = extremes(flat, real)
        n_bits = self._bits(flat, w_min, w_max, key, real)
        n = flat.shape[0]
        if self.huffman:
            q = quantize(flat, w_min, w_max, n_bits)
            lengths, _ = self._codebook(q, 2**self.ceiling)
            total = jnp.sum(lengths[q], dtype=jnp.uint32)
        else:
            total = jnp.uint32(n) * n_bits.astype(jnp.uint32)
        words = ((total + 31) >> 5).astype(jnp.int32)
        return EntropyPlan(n_bits, words)

    # -- encode / decode ----------------------------------------------------
    def encode(self, x: jax.Array, key: jax.Array | None = None, *,
               plan: EntropyPlan | None = None, valid: jax.Array | None = None) -> Payload:
        """Algorithm 1: worst-case sizes, or a plan's (`with_plan`)."""
        if plan is not None:
            return self.with_plan(plan).encode(x, key, valid=valid)
        flat = flat_values(x)
        real = real_count(valid)
        w_min, w_max = extremes(flat, real)
        n_bits = self._bits(flat, w_min, w_max, key, real)
        words = packed_words(flat.shape[0] * self.ceiling, 1, jnp.uint32)
        return self._pack(x, flat, w_min, w_max, n_bits, 2**self.ceiling, words, self.name)

    def _make_planned(self, bits: int, words: int) -> PlannedEntropyCompressor:
        name = self.plan_format(bits, words)
        encode = functools.partial(self._encode_planned, bits=bits, words=words, name=name)
        return PlannedEntropyCompressor(
            name, encode, self.decode, linear=False, stochastic=False, grouping="leaf",
            masks_padding=True, variant=self.variant, codec=self,
            plan=EntropyPlan(bits, words), **self.settings())

    def _encode_planned(self, x: jax.Array, key: jax.Array | None = None, *,
                        valid: jax.Array | None = None, bits: int, words: int,
                        name: str) -> Payload:
        """Encode sized by a plan: ``2**bits`` code lengths, ``words`` stream words."""
        flat = flat_values(x)
        w_min, w_max = extremes(flat, real_count(valid))
        return self._pack(x, flat, w_min, w_max, jnp.int32(bits), 2**bits, words, name)

    def _pack(self, x: jax.Array, flat: jax.Array, w_min: jax.Array, w_max: jax.Array,
              n_bits: jax.Array, symbols: int, words: int, name: str) -> Payload:
        q = quantize(flat, w_min, w_max, n_bits)
        arrays = {"bits": n_bits.astype(jnp.uint32)[None]}
        if self.huffman:
            lengths, codes = self._codebook(q, symbols)
            stream, offsets, total = hf.write_codes(codes[q], lengths[q], words)
            arrays["lengths"] = pack_bits(lengths, 4)
            arrays["blocks"] = offsets[:: self._block(flat.shape[0])]
        else:
            stream, _, total = hf.write_codes(q, n_bits, words)
        overflow = total > jnp.uint32(32 * words)
        nan = jnp.float32(jnp.nan)
        arrays["range"] = jnp.where(overflow, nan, jnp.stack([w_min, w_max]))
        arrays["stream"] = stream
        return Payload(arrays, tuple(jnp.shape(x)), jnp.asarray(x).dtype, name)

    def decode(self, payload: Payload) -> jax.Array:
        """Algorithm 2: rebuild the code from the lengths, decode, bin centres.

        Decodes this codec's payloads, unplanned or of any plan."""
        if self.variant(payload.format) is None:
            check_format(payload, self.name)
        n = math.prod(payload.shape)
        n_bits = payload["bits"][0]
        if self.huffman:
            symbols = 8 * payload["lengths"].shape[0]
            lengths = unpack_bits(payload["lengths"], 4, symbols)
            table = hf.decode_table(lengths)
            q = hf.read_codes(payload["stream"], payload["blocks"], table, n, self._block(n))
        else:
            q = hf.read_fixed(payload["stream"], n_bits, n)
        w_min, w_max = payload["range"][0], payload["range"][1]
        step = jnp.ldexp(jnp.float32(1.0), -n_bits.astype(jnp.int32))
        # w_min + span * f, with the span taken as twice its half: finite
        # whenever the range is (added one half at a time where 2 half * f
        # alone would overflow).
        part = (0.5 * w_max - 0.5 * w_min) * ((q.astype(jnp.float32) + 0.5) * step)
        whole = w_min + (part + part)
        values = jnp.where(jnp.isfinite(whole) | ~jnp.isfinite(part), whole, (w_min + part) + part)
        return values.reshape(payload.shape).astype(payload.dtype)

