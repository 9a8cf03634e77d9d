"""Reference quantizers and bit packing: the packed layout every kernel reads.

Everything here is plain PyTorch and reads like the sections on online quantization and packed
storage of ``docs/method.md``.
The Triton kernels in ``pnmix_patch.kernels`` produce and consume exactly these
tensors and are tested against these functions.

Asymmetric min-max quantization of a group ``x`` to ``b`` bits::

    scale = (max - min) / (2**b - 1),  zero = min
    code  = clamp(round((x - zero) / scale), 0, 2**b - 1)
    x_hat = zero + code * scale

1-bit midpoint correction: plain 1-bit reconstructs only {min, max}. With the
correction the two levels are ``min + 0.25 * range`` and ``min + 0.75 * range``;
it is stored as ``zero = min + 0.25 * range, scale = 0.5 * range`` so that every
reader (reference or kernel) reconstructs with the same ``zero + code * scale``.
The code is the nearest level, i.e. ``x >= min + range / 2``.

Scales and zeros are stored in a 16-bit float (bf16 for bf16 models, fp16
otherwise); codes are computed from the *stored* 16-bit scale and zero so that
packing and reading agree exactly.

Edge cases (decided here, tested in ``tests/test_quantize.py``):

- a constant group (zero range) has ``scale = 0``: every code is 0 and reads back
  exactly as ``zero``; no division by zero;
- a group holding inf or NaN gets ``scale = zero = NaN``: the whole group reads
  back NaN, like unquantized attention over a non-finite key would, never as
  finite garbage.

Bit packing (bit planes): ``b``-bit codes along an axis of length ``n`` (a multiple
of 32) are stored as ``b`` planes of ``n / 32`` int32 words; bit ``t % 32`` of word
``t // 32`` of plane ``p`` is bit ``p`` of code ``t``. Any width packs exactly
(3 bits cost 3 bits), and a reader rebuilds a code with shifts and masks.

Packed cache layout (per layer; ``C_hi = 2 * selected pairs``; channels of a head are
stored *selected first*, each part in increasing channel order, see :func:`channel_order`):

=====================  ===============================================  =======
tensor                 shape                                            dtype
=====================  ===============================================  =======
key codes, high        ``[B, H, groups, b_H - b_L, G/32, C_hi]``        int32
key codes, low         ``[B, H, groups, b_L, G/32, D]``                 int32
key scale / zero       ``[B, H, groups, D]`` (stored order)             16-bit
value codes            ``[B, H, groups*G, b_V, D/32]``                  int32
value scale / zero     ``[B, H, groups*G, D/Gv]``                       16-bit
=====================  ===============================================  =======

A selected channel's code has ``b_H`` bits, another's ``b_L``. The low codes tensor holds
planes ``0 .. b_L - 1`` of every channel's code, the high one planes ``b_L .. b_H - 1`` of
the selected channels' codes (:func:`unpack_stored_keys`: ``code = low + 2^b_L * high``).
The bits are those of one tensor of ``b_H`` planes for the selected channels and one of
``b_L`` for the others (``b_L * D + (b_H - b_L) * C_hi = b_H * C_hi + b_L * (D - C_hi)``),
split so that the low tensor spans whole 32-channel chunks (``D`` is a multiple of 32),
which the kernel's fastest word order needs, and the high one is one pair of planes for
every preset.

Keys are packed along tokens (quantized per channel), values along channels
(quantized per token), so a 32-token tile of keys is one row of words.

Operand order: the words are then rearranged, without changing what they hold, into
the order the CUDA decode kernel (``kernels/decode_attention_mma.py``) makes its 8-bit
tensor-core operands from, so that it copies them and reads them as they are instead
of byte-transposing every group in shared memory. A permutation of the bits of each
plane of each group (:func:`keys_to_operand_order`, :func:`values_to_operand_order`):

- keys, thread-owned words, with ``G`` a multiple of 64 in a codes tensor of a multiple
  of 32 channels, or of a multiple of 4 channels whose planes come in pairs
  (:func:`thread_owned_keys`: every preset's tensors but the high one of ``pnmix-2`` at
  head dim 64, 26 channels). Each word holds the 32 bits one thread of the kernel's MMA
  needs of a 32-channel chunk: the rows ``g`` and ``g + 8`` of two 16-token tiles ``S``
  tokens apart (:func:`key_tile_distance`: ``S`` = 64, or 32 where ``G`` is not a
  multiple of 128) and the channels ``4l .. 4l + 3`` and ``16 + 4l .. 16 + 4l + 3`` (a
  kernel step of 128 tokens gives a warp both tiles; in a step of 64 tokens a warp holds
  one of them and uses half of each word). Token ``t`` of the group is (block ``t // 2S``,
  tile ``t // S % 2``, tile pair ``t % S // 16``, row half ``t // 8 % 2``, lane row ``g =
  t % 8``); channel ``c`` of the tensor is (chunk ``c // 32``, half ``c // 16 % 2``, lane
  column ``l = c // 4 % 4``, byte ``i = c % 4``). Its code bit is bit ``8i + 4 tile + 2
  half + row half`` of word row ``block * S/16 + tile pair``, word ``32 chunk + 4g + l``.
  (In the byte-quad order below a word serves eight threads, so eight of them read it;
  here each thread reads only its own.) Then each pair of planes ``(2m, 2m + 1)`` is
  stored as two words of 2-bit fields (:func:`key_planes_to_fields`), so that one 8-bit
  operand carries two planes: the pair's slot ``2m + h`` (``h``, the chunk's half) holds,
  at bits ``8i + 4 tile + 2 row half + j``, bit ``j`` of the 2-bit code ``(code >> 2m) &
  3`` of the channel of half ``h`` (the plane word's bit ``8i + 4 tile + 2h + row half``
  of plane ``2m + j``); an odd last plane stays a plane word. A last chunk of ``P = C %
  32`` channels (``pnmix-2``'s high tensor at head dim 128: 20 of its 52) is compacted
  (:func:`compact_key_fields`): of each slot only the words of lane columns that hold
  channels are stored (``min(P, 16) / 4`` in the first half, ``(P - min(P, 16)) / 4`` in
  the second), for each pair and word row the first half's words then the second half's,
  each in word order, ``2P`` words in all: the first ``P`` at the chunk's place in slot
  ``2m``, the rest in slot ``2m + 1``. So the tensor keeps its shape and its bytes;
- keys of other tensors: the words of four consecutive stored channels ``4q .. 4q + 3``
  (same plane and word row) are byte-transposed (:func:`transpose_byte_quads`: in a run of
  four words, word ``b``'s byte ``i`` is byte ``b`` of word ``i``): bit ``8i + j`` of word
  ``4q + b`` is token ``32w + 8b + j`` of channel ``4q + i``. When the tensor's channel
  count is not a multiple of 4, its last ``C % 4`` words stay plain;
- values (:func:`values_to_operand_order`), per block of ``token_block`` tokens (the key
  group size ``G``). First each token's planes are taken in pairs ``(2m, 2m + 1)`` and
  stored as 2-bit fields (:func:`planes_to_fields`): the pair's ``2 * D/32`` words hold
  ``D/16`` field words, channel ``16u + k`` at bits ``2k`` (plane ``2m``) and ``2k + 1``
  (plane ``2m + 1``) of field word ``u``, with bit 7 of every byte inverted (the top field
  of a byte then reads as ``64 * (code - 2)`` in a signed int8, see the kernel); an odd last
  plane stays a plane. Then the words of four consecutive tokens ``4tq .. 4tq + 3`` (same
  word column) are byte-transposed, and the block's ``[G, b_V, D/32]`` words are stored as
  ``[b_V * D/32, 4, G/4]``: byte ``i`` of word ``(column, b, tq)`` is byte ``b`` of token
  ``4tq + i``'s word ``column``. With 2-bit values, bits ``2k, 2k + 1`` of byte ``i`` of
  word ``(u, b, tq)`` are channel ``16u + 4b + k`` of token ``4tq + i`` (so a word row is
  ``channel // 4``). A last block of fewer than ``G`` tokens stays plain (bit planes).

A reader that wants plain words applies the inverse (:func:`keys_from_operand_order`,
:func:`values_from_operand_order`); the unpacking functions below (:func:`unpack_keys`,
:func:`unpack_values`) read the codes without rebuilding plain words.
"""

from __future__ import annotations

import sys

import torch

WORD_BITS = 32


def scale_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """16-bit float used for scales and zeros of a cache in ``dtype``."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float16


def minmax_params(
    x: torch.Tensor, bits: int, dim: int, midpoint_correction: bool, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero of asymmetric min-max quantization of ``x`` over ``dim`` (kept, size 1)."""
    x = x.float()
    low = x.amin(dim, keepdim=True)
    high = x.amax(dim, keepdim=True)
    value_range = high - low
    if bits == 1 and midpoint_correction:
        zero, scale = low + 0.25 * value_range, 0.5 * value_range
    else:
        zero, scale = low, value_range / (2**bits - 1)
    finite = torch.isfinite(x).all(dim, keepdim=True)
    nan = torch.tensor(float("nan"), device=x.device)
    return torch.where(finite, scale, nan).to(scale_dtype), torch.where(finite, zero, nan).to(scale_dtype)


def encode(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (int32) of ``x`` for the given (broadcastable) stored scale and zero."""
    scale, zero = scale.float(), zero.float()
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    codes = torch.round((x.float() - zero) * inverse).clamp_(0, 2**bits - 1)
    return torch.nan_to_num(codes, nan=0.0).to(torch.int32)


def decode(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Reconstruction ``zero + code * scale`` in float32."""
    return zero.float() + codes.float() * scale.float()


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``codes[..., n]`` (n a multiple of 32) into bit planes ``int32[..., bits, n/32]``."""
    n = codes.shape[-1]
    if n % WORD_BITS:
        raise ValueError(f"cannot pack {n} codes: allowed a multiple of {WORD_BITS}")
    words = codes.to(torch.int64).reshape(*codes.shape[:-1], 1, n // WORD_BITS, WORD_BITS)
    planes = torch.arange(bits, device=codes.device).view(bits, 1, 1)
    positions = torch.arange(WORD_BITS, device=codes.device)
    return _to_int32((((words >> planes) & 1) << positions).sum(-1))


def _to_int32(packed: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit values held in int64, reinterpreted as int32 (two's complement)."""
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _bits_of_words(words: torch.Tensor) -> torch.Tensor:
    """Bits ``uint8[..., n, 32]`` of int32 words ``[..., n]``: bit ``b`` of word ``w`` at ``[w, b]``."""
    if sys.byteorder == "little":
        # Bytes throughout (a quarter of int32's memory traffic): bit b of a word is bit b % 8 of its byte b // 8.
        word_bytes = words.to(torch.int32).flatten().view(torch.uint8).reshape(*words.shape, 4, 1)
        return ((word_bytes >> torch.arange(8, dtype=torch.uint8, device=words.device)) & 1).reshape(*words.shape, 32)
    # int32 (faster on CPU than int64): the arithmetic shift of a negative word still leaves bit 31 in bit 0.
    return ((words.to(torch.int32).unsqueeze(-1) >> torch.arange(WORD_BITS, dtype=torch.int32, device=words.device)) & 1).to(torch.uint8)


def _codes_per_bit(planes: torch.Tensor, word_dims: int) -> torch.Tensor:
    """The code at each bit position of bit-plane words ``[..., b, *words]`` (``words``: the last
    ``word_dims`` dims): ``[..., *words, 32]``, bit ``p`` of a code from plane ``p``. Combined in bytes
    for codes of at most 8 bits, else int32."""
    count = planes.shape[-1 - word_dims]
    dtype = torch.uint8 if count <= 8 else torch.int32
    weights = torch.arange(count, dtype=dtype, device=planes.device).view(count, *[1] * (word_dims + 1))
    return (_bits_of_words(planes).to(dtype) << weights).sum(-2 - word_dims, dtype=dtype)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``int32[..., bits, n/32]`` to codes ``int32[..., n]``."""
    return _codes_per_bit(packed, 1).reshape(*packed.shape[:-2], packed.shape[-1] * WORD_BITS).to(torch.int32)


def transpose_byte_quads(words: torch.Tensor, dim: int) -> torch.Tensor:
    """``words`` (int32) with each run of four consecutive words along ``dim`` byte-transposed
    (word ``b``'s byte ``i`` becomes byte ``b`` of word ``i``; its own inverse). The last
    ``n % 4`` words along ``dim`` stay as they are."""
    words = words.movedim(dim, -1)
    full = words.shape[-1] - words.shape[-1] % 4
    if full and words.numel():
        quads = words[..., :full].contiguous().view(torch.uint8).unflatten(-1, (full // 4, 4, 4))
        words = torch.cat([quads.transpose(-1, -2).contiguous().flatten(-3).view(torch.int32), words[..., full:]], -1)
    return words.movedim(-1, dim).contiguous()


def key_code_shape(groups: int, planes: int, group_size: int, channels: int) -> tuple[int, int, int, int]:
    """Shape of one head's packed key codes (the layout table): ``groups`` groups of ``planes`` bit
    planes, each ``group_size / 32`` int32 words of 32 tokens for each of ``channels`` channels."""
    return groups, planes, group_size // WORD_BITS, channels


_WORD_FROM_TOKEN_DIMS = (0, 2, 5, 4, 7, 8, 1, 6, 3)
"""A thread-owned key word's bits (module docstring, "keys") from a token's dims ``[block, tile, tile
pair, row half, lane row]`` and a channel's ``[chunk, half, lane column, byte]``: word row ``[block,
tile pair]``, word column ``[chunk, lane row, lane column]``, bit ``[byte, tile, half, row half]``."""


def key_tile_distance(group_size: int) -> int:
    """Tokens from the first to the second 16-token tile of a thread-owned key word: 64 where
    ``group_size`` is a multiple of 128, else 32 (module docstring, "keys")."""
    return 64 if group_size % 128 == 0 else 32


def thread_owned_keys(group_size: int, channels: int, planes: int) -> bool:
    """Whether a key codes tensor of ``planes`` planes of ``channels`` channels over ``group_size``-token
    groups stores thread-owned words (else runs of four channels byte-transposed; module docstring,
    "keys"): ``G`` a multiple of 64 and the channels whole 32-channel chunks, or a last partial chunk
    of a multiple of 4 channels whose planes all come in pairs (stored compacted,
    :func:`compact_key_fields`)."""
    if group_size % 64:
        return False
    return planes == 0 or channels % 32 == 0 or (planes % 2 == 0 and channels % 4 == 0)


def key_word_distance(group_size: int, channels: int, planes: int) -> int:
    """A key codes tensor's word order as the kernels take it (a constexpr): the
    :func:`key_tile_distance` of its thread-owned words, or 0 for byte-transposed runs of four
    (:func:`thread_owned_keys`)."""
    return key_tile_distance(group_size) if thread_owned_keys(group_size, channels, planes) else 0


def partial_chunk_lanes(channels: int) -> tuple[int, int]:
    """Lane columns of a thread-owned key tensor's last, partial 32-channel chunk that hold channels,
    in its first and its second half (``channels % 32 = 16 + 4 * 1`` gives ``(4, 1)``; a whole
    last chunk ``(0, 0)``): its field words exist for those lanes only (:func:`compact_key_fields`)."""
    partial = channels % 32
    first = min(partial, 16)
    return first // 4, (partial - first) // 4


def compact_key_fields(words: torch.Tensor, channels: int) -> torch.Tensor:
    """Thread-owned field words ``[..., b, G/32, C']`` of a tensor padded to whole chunks (``C'`` the
    multiple of 32 above ``channels``, zero codes past ``channels``) as stored, ``[..., b, G/32,
    channels]``: the whole chunks' words as they are, and of the last chunk, for each pair of slots
    and word row, only the words of lanes that hold channels (:func:`partial_chunk_lanes`), its first
    half's (slot ``2m``) then its second half's (slot ``2m + 1``), each lane row by lane row (word
    ``4g + l`` in order): ``2 * (channels % 32)`` words, the first ``channels % 32`` at slot ``2m``,
    the rest at slot ``2m + 1`` (module docstring, "keys")."""
    full = channels - channels % 32
    if full == channels:
        return words
    *lead, planes, rows, _ = words.shape
    lanes = partial_chunk_lanes(channels)
    last = words[..., full : full + 32].reshape(*lead, planes // 2, 2, rows, 8, 4)
    pool = torch.cat([last[..., h, :, :, : lanes[h]].reshape(*lead, planes // 2, rows, 8 * lanes[h]) for h in (0, 1)], -1)
    tail = pool.unflatten(-1, (2, channels - full)).movedim(-2, -3).reshape(*lead, planes, rows, channels - full)
    return torch.cat([words[..., :full], tail], -1)


def expand_key_fields(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`compact_key_fields`: the words padded to whole chunks, zeros where no lane
    holds channels."""
    *lead, planes, rows, channels = words.shape
    full = channels - channels % 32
    if full == channels:
        return words
    lanes = partial_chunk_lanes(channels)
    pool = words[..., full:].reshape(*lead, planes // 2, 2, rows, channels - full).movedim(-3, -2).flatten(-2)
    last = words.new_zeros(*lead, planes // 2, 2, rows, 8, 4)
    for h, start in ((0, 0), (1, 8 * lanes[0])):
        last[..., h, :, :, : lanes[h]] = pool[..., start : start + 8 * lanes[h]].reshape(*lead, planes // 2, rows, 8, lanes[h])
    return torch.cat([words[..., :full], last.reshape(*lead, planes, rows, 32)], -1)


def _words_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_bits_of_words`."""
    return _to_int32((bits.to(torch.int64) << torch.arange(WORD_BITS, device=bits.device)).sum(-1))


_FIELDS_FROM_PLANES_DIMS = (0, 6, 2, 3, 4, 5, 7, 1)
"""A pair of thread-owned plane words' bits ``[pair, plane j, word row, word, byte, tile, half, row
half]`` as field words ``[pair, half, word row, word, byte, tile, row half, j]`` (module docstring,
"keys")."""
_PLANES_FROM_FIELDS_DIMS = tuple(_FIELDS_FROM_PLANES_DIMS.index(d) for d in range(8))


def _permute_pairs(words: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The whole pairs of planes of thread-owned key words ``[..., b, G/32, C]`` with each pair's bits
    permuted by ``dims`` (:data:`_FIELDS_FROM_PLANES_DIMS` or its inverse); an odd last plane as it is."""
    *lead, planes, rows, channels = words.shape
    pairs = planes // 2
    if not pairs:
        return words
    bits = _bits_of_words(words[..., : 2 * pairs, :, :]).reshape(*lead, pairs, 2, rows, channels, 4, 2, 2, 2)
    bits = bits.permute(*range(len(lead)), *(len(lead) + d for d in dims))
    return torch.cat([_words_of_bits(bits.reshape(*lead, 2 * pairs, rows, channels, WORD_BITS)), words[..., 2 * pairs :, :, :]], -3)


def key_planes_to_fields(words: torch.Tensor) -> torch.Tensor:
    """Thread-owned key plane words ``[..., b, G/32, C]`` with each pair of planes ``(2m, 2m + 1)``
    as two words of 2-bit fields, the chunk's first half's at slot ``2m`` and its second half's at
    ``2m + 1`` (module docstring, "keys"); an odd last plane stays a plane."""
    return _permute_pairs(words, _FIELDS_FROM_PLANES_DIMS)


def key_fields_to_planes(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`key_planes_to_fields`."""
    return _permute_pairs(words, _PLANES_FROM_FIELDS_DIMS)


def _thread_owned_dims(group_size: int, channels: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Sizes of a token's dims ``[block, tile, tile pair, row half, lane row]`` and a channel's
    ``[chunk, half, lane column, byte]`` (module docstring, "keys")."""
    distance = key_tile_distance(group_size)
    return (group_size // (2 * distance), 2, distance // 16, 2, 8), (channels // 32, 2, 4, 4)


_FIELD_FROM_TOKEN_DIMS = (6, 0, 2, 5, 4, 7, 8, 1, 3)
"""The 2-bit fields of a pair's two slots (module docstring, "keys") as ``[half, word row, word,
byte, field]`` by a token's and a channel's dims (as :data:`_WORD_FROM_TOKEN_DIMS`): half ``[half]``,
word row ``[block, tile pair]``, word ``[chunk, lane row, lane column]``, byte, field ``[tile, row
half]``."""


def _in_token_order(
    values: torch.Tensor, lead: list[int], rows: int, channels: int, word_dims: tuple[int, ...] = _WORD_FROM_TOKEN_DIMS
) -> torch.Tensor:
    """Values at the bits of thread-owned key words (a bit, or a code made of the planes' bits),
    ``[*lead, G/32, C, 32]``, or, with ``word_dims`` :data:`_FIELD_FROM_TOKEN_DIMS`, at the fields of
    a pair's two slots, ``[*lead, 2, G/32, C, 16]`` -> ``[*lead, G, C]`` by token and channel."""
    sizes = sum(_thread_owned_dims(32 * rows, channels), ())
    values = values.reshape(*lead, *(sizes[d] for d in word_dims))
    inverse = tuple(word_dims.index(d) for d in range(len(word_dims)))
    return values.permute(*range(len(lead)), *(len(lead) + d for d in inverse)).reshape(*lead, 32 * rows, channels)


def keys_to_operand_order(codes: torch.Tensor) -> torch.Tensor:
    """Key words ``[..., b, G/32, C]`` (plain bit planes: bit ``t % 32`` of word ``(p, t // 32, c)`` is
    bit ``p`` of token ``t``'s code of channel ``c``) in operand order (module docstring, "keys")."""
    *lead, planes, rows, channels = codes.shape
    group_size = 32 * rows
    if not thread_owned_keys(group_size, channels, planes):
        return transpose_byte_quads(codes, -1)
    padded = -channels % 32
    codes = torch.nn.functional.pad(codes, (0, padded))
    token_dims, channel_dims = _thread_owned_dims(group_size, channels + padded)
    bits = _bits_of_words(codes).transpose(-1, -2).reshape(*lead, planes, *token_dims, *channel_dims)
    bits = bits.permute(*range(len(lead) + 1), *(len(lead) + 1 + d for d in _WORD_FROM_TOKEN_DIMS))
    words = key_planes_to_fields(_words_of_bits(bits.reshape(*lead, planes, rows, channels + padded, WORD_BITS)))
    return compact_key_fields(words, channels)


def keys_from_operand_order(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`keys_to_operand_order`."""
    *lead, planes, rows, channels = codes.shape
    if not thread_owned_keys(32 * rows, channels, planes):
        return transpose_byte_quads(codes, -1)  # its own inverse
    codes = expand_key_fields(codes)
    padded = codes.shape[-1]
    bits = _in_token_order(_bits_of_words(key_fields_to_planes(codes)), [*lead, planes], rows, padded)
    return _words_of_bits(bits.reshape(*lead, planes, rows, WORD_BITS, padded).transpose(-1, -2))[..., :channels]


def _thread_owned_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., G, C]`` of a thread-owned key codes tensor ``[..., b, G/32, C]`` in operand order:
    the pairs' 2-bit fields read from the words' bytes in place (bytes for codes of at most 8 bits,
    else int32), the odd last plane's bits added on top."""
    channels = codes.shape[-1]
    codes = expand_key_fields(codes)
    *lead, planes, rows, padded = codes.shape
    pairs = planes // 2
    if not pairs or sys.byteorder != "little":
        return _in_token_order(_codes_per_bit(key_fields_to_planes(codes), 2), lead, rows, padded)[..., :channels]
    dtype = torch.uint8 if planes <= 8 else torch.int32
    # Byte i of slot 2m + half holds field f = 2 tile + row half at bits 2f, 2f + 1: [..., pair, half, rows, C, i, f].
    word_bytes = codes[..., : 2 * pairs, :, :].contiguous().view(torch.uint8).reshape(*lead, pairs, 2, rows, padded, 4, 1)
    fields = ((word_bytes >> torch.arange(0, 8, 2, dtype=torch.uint8, device=codes.device)) & 3).to(dtype)
    weights = 2 * torch.arange(pairs, dtype=dtype, device=codes.device).view(pairs, 1, 1, 1, 1, 1)
    fields = (fields << weights).sum(-6, dtype=dtype) if pairs > 1 else fields.squeeze(-6)  # [..., half, rows, C, i, f]
    if planes % 2:  # the odd last plane's bit 8i + 4 tile + 2 half + row half, in the fields' order
        top = codes[..., -1:, :, :].contiguous().view(torch.uint8).reshape(*lead, 1, rows, padded, 4, 1)
        positions = torch.tensor([[0, 1, 4, 5], [2, 3, 6, 7]], dtype=torch.uint8, device=codes.device)  # [half, f]
        fields = fields + (((top >> positions.view(2, 1, 1, 1, 4)) & 1).to(dtype) << (2 * pairs))
    return _in_token_order(fields, lead, rows, padded, _FIELD_FROM_TOKEN_DIMS)[..., :channels]


def unpack_keys(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``int32[..., G, C]`` of a key codes tensor ``[..., b, G/32, C]`` as :func:`quantize_keys`
    stores it (``b`` bit planes in operand order)."""
    planes, rows, channels = codes.shape[-3:]
    if not planes:
        return codes.new_zeros(*codes.shape[:-3], 32 * rows, channels)
    if not thread_owned_keys(32 * rows, channels, planes):  # plain words: [..., C, b, G/32] -> [..., C, G]
        return unpack_bits(transpose_byte_quads(codes, -1).movedim(-1, -3)).transpose(-1, -2)
    return _thread_owned_codes(codes).to(torch.int32)


def pack_key_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Plain bit-plane words ``int32[..., bits, G/32, C]`` of key codes ``[..., G, C]`` (packed along
    tokens, channels innermost; no operand order)."""
    return pack_bits(codes.transpose(-1, -2), bits).movedim(-3, -1)


def unpack_key_codes(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_key_codes`: codes ``int32[..., G, C]``."""
    return unpack_bits(words.movedim(-1, -3)).transpose(-1, -2)


def check_token_block(token_block: int) -> None:
    """Raise ``ValueError`` unless ``token_block`` (the key group size) is a positive multiple of 4."""
    if token_block <= 0 or token_block % 4:
        raise ValueError(f"token_block must be a positive multiple of 4 (the key group size), got {token_block}")


FIELD_SIGN_FLIP = -0x7F7F7F80
"""``0x80808080`` as an int32: bit 7 of every byte, inverted in field words (:func:`planes_to_fields`)."""


def planes_to_fields(words: torch.Tensor) -> torch.Tensor:
    """Bit-plane words ``[..., b_V, D/32]`` of one token with each pair of planes ``(2m, 2m + 1)``
    as 2-bit field words (module docstring, "values"); an odd last plane stays as it is."""
    *lead, bits, width = words.shape
    pairs = bits // 2
    if not pairs:
        return words
    codes = unpack_bits(words[..., : 2 * pairs, :].reshape(*lead, pairs, 2, width))  # [..., pairs, D]: 2-bit codes
    fields = codes.reshape(*lead, pairs, 2 * width, 16).to(torch.int64) << (2 * torch.arange(16, device=words.device))
    fields = _to_int32(fields.sum(-1)) ^ FIELD_SIGN_FLIP
    return torch.cat([fields.reshape(*lead, 2 * pairs, width), words[..., 2 * pairs :, :]], -2)


def unpack_fields(words: torch.Tensor) -> torch.Tensor:
    """Codes ``int32[..., D]`` of one token's words as :func:`planes_to_fields` leaves them
    (``[..., b_V, D/32]``): ``unpack_bits(fields_to_planes(words))``, read from the fields without
    rebuilding the planes."""
    *lead, bits, width = words.shape
    pairs = bits // 2
    fields = words[..., : 2 * pairs, :].reshape(*lead, pairs, 2 * width, 1) ^ FIELD_SIGN_FLIP
    # int32: masked, the arithmetic shift of a negative word still gives its top field (as in unpack_bits'
    # int32 path); field word u of pair m: channel 16u + k at bits 2k, 2k + 1.
    pair_codes = ((fields >> (2 * torch.arange(16, dtype=torch.int32, device=words.device))) & 3).reshape(*lead, pairs, 32 * width)
    weights = 2 * torch.arange(pairs, dtype=torch.int32, device=words.device).view(pairs, 1)
    codes = (pair_codes << weights).sum(-2, dtype=torch.int32)
    if bits % 2:  # the odd last plane, the code's top bit
        codes = codes + (unpack_bits(words[..., 2 * pairs :, :]) << (bits - 1))
    return codes


def fields_to_planes(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`planes_to_fields`."""
    return pack_bits(unpack_fields(words), words.shape[-2])


def values_to_operand_order(codes: torch.Tensor, token_block: int) -> torch.Tensor:
    """Value words ``[B, H, T, b_V, D/32]`` (plain: per token, bit planes) in operand order, per
    block of ``token_block`` tokens (module docstring)."""
    check_token_block(token_block)
    *lead, tokens, bits, words = codes.shape
    full = tokens - tokens % token_block
    blocks = transpose_byte_quads(planes_to_fields(codes[..., :full, :, :]), -3)
    blocks = blocks.reshape(*lead, full // token_block, token_block // 4, 4, bits, words)
    blocks = blocks.movedim((-4, -3), (-1, -2))  # [.., block, block / 4, 4, bits, words] -> [.., block, bits, words, 4, block / 4]
    return torch.cat([blocks.reshape(*lead, full, bits, words), codes[..., full:, :, :]], -3)


def _value_fields(codes: torch.Tensor, token_block: int) -> tuple[torch.Tensor, int]:
    """The words of the whole blocks of :func:`values_to_operand_order` output back in token order,
    still as field words (``[..., full, b_V, D/32]``), and ``full``, their token count."""
    check_token_block(token_block)
    *lead, tokens, bits, words = codes.shape
    full = tokens - tokens % token_block
    blocks = codes[..., :full, :, :].reshape(*lead, full // token_block, bits, words, 4, token_block // 4)
    blocks = blocks.movedim((-1, -2), (-4, -3)).reshape(*lead, full, bits, words)
    return transpose_byte_quads(blocks, -3), full


def values_from_operand_order(codes: torch.Tensor, token_block: int) -> torch.Tensor:
    """Inverse of :func:`values_to_operand_order`."""
    fields, full = _value_fields(codes, token_block)
    return torch.cat([fields_to_planes(fields), codes[..., full:, :, :]], -3)


def unpack_values(codes: torch.Tensor, token_block: int) -> torch.Tensor:
    """Value codes ``int32[..., T, D]`` of :func:`values_to_operand_order` output:
    ``unpack_bits(values_from_operand_order(codes, token_block))``, reading the field words
    directly (:func:`unpack_fields`), which is faster on CPU than rebuilding the planes."""
    fields, full = _value_fields(codes, token_block)
    return torch.cat([unpack_fields(fields), unpack_bits(codes[..., full:, :, :])], -2)


def channel_order(channel_mask: torch.Tensor) -> torch.Tensor:
    """Storage order of a head's channels: selected channels first, each part ascending.

    ``channel_mask`` is bool ``[..., D]``; returns int64 ``[..., D]`` such that
    ``stored = original.gather(-1, order)``.
    """
    return torch.argsort((~channel_mask).to(torch.int8), dim=-1, stable=True)


def quantize_keys(
    keys: torch.Tensor,
    channel_mask: torch.Tensor,
    num_high: int,
    group_size: int,
    bits_high: int,
    bits_low: int,
    midpoint_correction: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize keys per channel over groups of ``group_size`` tokens.

    Args:
        keys: ``[B, H, T, D]`` with ``T`` a multiple of ``group_size``.
        channel_mask: bool ``[B, H, D]``, True for channels of selected pairs; exactly
            ``num_high`` True per head.
    Returns:
        ``(codes_high [B, H, T/G, b_H - b_L, G/32, C_hi], codes_low [B, H, T/G, b_L, G/32, D],
        scale [B, H, T/G, D], zero [B, H, T/G, D])``, channels in :func:`channel_order`: the low
        ``b_L`` planes of every channel's code and the upper ones of the selected channels' codes.
    """
    batch, heads, tokens, head_dim = keys.shape
    groups = tokens // group_size
    order = channel_order(channel_mask)
    stored = keys.gather(-1, order.unsqueeze(2).expand(-1, -1, tokens, -1))
    stored = stored.reshape(batch, heads, groups, group_size, head_dim)
    scale_dtype = scale_dtype_for(keys.dtype)
    codes, scales, zeros = [], [], []
    for part, bits in ((stored[..., :num_high], bits_high), (stored[..., num_high:], bits_low)):
        scale, zero = minmax_params(part, bits, 3, midpoint_correction, scale_dtype)
        codes.append(encode(part, scale, zero, bits))
        scales.append(scale.squeeze(3))
        zeros.append(zero.squeeze(3))
    codes = torch.cat(codes, -1)
    codes_low = keys_to_operand_order(pack_key_codes(codes & ((1 << bits_low) - 1), bits_low))
    codes_high = keys_to_operand_order(pack_key_codes(codes[..., :num_high] >> bits_low, bits_high - bits_low))
    return codes_high, codes_low, torch.cat(scales, -1), torch.cat(zeros, -1)


def unpack_stored_keys(codes_high: torch.Tensor, codes_low: torch.Tensor) -> torch.Tensor:
    """Codes ``int32[..., G, D]`` of the stored channels from :func:`quantize_keys`' two codes
    tensors: the low planes of every channel plus the upper planes of the selected ones."""
    codes = unpack_keys(codes_low)
    num_high = codes_high.shape[-1]
    upper = unpack_keys(codes_high) << codes_low.shape[-3]
    return torch.cat([codes[..., :num_high] + upper, codes[..., num_high:]], -1)


def dequantize_keys(
    codes_high: torch.Tensor,
    codes_low: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    channel_mask: torch.Tensor,
) -> torch.Tensor:
    """Float32 keys ``[B, H, groups*G, D]`` in the original channel order.

    ``channel_mask`` is bool ``[B, H, D]`` (one selection per sequence) or
    ``[B, H, groups, D]`` (a selection per group, as written by per-group re-selection).
    """
    stored = decode(unpack_stored_keys(codes_high, codes_low), scale.unsqueeze(3), zero.unsqueeze(3))
    batch, heads, groups, group_size, head_dim = stored.shape
    stored = stored.reshape(batch, heads, groups * group_size, head_dim)
    if channel_mask.dim() == 4:
        order = channel_order(channel_mask).repeat_interleave(group_size, dim=2)
    else:
        order = channel_order(channel_mask).unsqueeze(2).expand(-1, -1, groups * group_size, -1)
    return torch.empty_like(stored).scatter_(-1, order, stored)


def quantize_values(
    values: torch.Tensor, bits: int, group_size: int, midpoint_correction: bool, token_block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize values per token over groups of ``group_size`` channels.

    ``values [B, H, T, D]`` -> ``(codes [B, H, T, bits, D/32], scale [B, H, T, D/Gv], zero)``,
    the codes in operand order per block of ``token_block`` tokens (the key group size).
    """
    batch, heads, tokens, head_dim = values.shape
    grouped = values.reshape(batch, heads, tokens, head_dim // group_size, group_size)
    scale, zero = minmax_params(grouped, bits, -1, midpoint_correction, scale_dtype_for(values.dtype))
    codes = encode(grouped, scale, zero, bits).reshape(batch, heads, tokens, head_dim)
    return values_to_operand_order(pack_bits(codes, bits), token_block), scale.squeeze(-1), zero.squeeze(-1)


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, token_block: int) -> torch.Tensor:
    """Float32 values ``[B, H, T, D]`` from :func:`quantize_values` output (same ``token_block``)."""
    unpacked = unpack_values(codes, token_block)
    batch, heads, tokens, head_dim = unpacked.shape
    groups = scale.shape[-1]
    grouped = unpacked.reshape(batch, heads, tokens, groups, head_dim // groups)
    return decode(grouped, scale.unsqueeze(-1), zero.unsqueeze(-1)).reshape(batch, heads, tokens, head_dim)
