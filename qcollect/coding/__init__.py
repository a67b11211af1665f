"""Bit-level wire formats: how the codes of a payload are laid out in words.

Packing of ``k``-bit codes into ``uint8`` or ``uint32`` words, the sparse
entry words (sign bit + 31-bit index) with their header and static-capacity
selection, Golomb-Rice coding of sorted index gaps, and canonical
length-limited Huffman codes written and read with static shapes. Every
compressor writes its payload through these, so a 1-bit payload really is one
bit per value. docs/compressors.md#wire-formats describes each format.

This folder imports the core only (the modules directly under ``qcollect/``),
never ``compressors/``, ``collectives/`` or ``measure/``. It re-exports
nothing: the public names (`qcollect.pack_bits`, `qcollect.unpack_bits`,
`qcollect.packed_words`) live in the flat ``qcollect`` namespace.
"""
