"""Masks for secure aggregation: seeds expanded by ChaCha20 into ring elements, the pairing graph,
and the participant's masking of one tensor.

A mask is the ChaCha20 keystream of a 32-byte seed, read as little-endian uint16/uint32 ring
elements. The 16-byte ChaCha20 IV is a zero block counter and 12 bytes of
SHA-256("fedtrain/secagg/mask", kind, tensor name): every (seed, kind, tensor) has its own
stream, and seeds are fresh every round (pairwise seeds by HKDF over the round, self seeds drawn
at random), so no stream is ever reused across tensors, kinds or rounds.

Participant u uploads, for each tensor,

    y_u = x_u + PRG(b_u) + Σ_{v ∈ N(u), v > u} PRG(s_uv) − Σ_{v ∈ N(u), v < u} PRG(s_uv)   (mod 2^b)

(Bonawitz et al. 2017): the pairwise terms cancel in the sum over participants, the self mask
b_u hides x_u even if a pairwise key is later revealed because u was (wrongly) declared dropped.
N(u) is u's neighbours: every other participant (full pairing, small N) or k of them in a
Harary graph H(k, n) laid over a permutation drawn from a public seed (Bell et al. 2020,
"SecAgg+"), so each participant derives k masks rather than n − 1.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from fedtrain.privacy.deps import crypto
from fedtrain.privacy.failures import PrivacyError
from fedtrain.privacy.keys import check_participant_id
from fedtrain.privacy.ring import FixedPoint, ring_add, ring_sub

SEED_BYTES = 32
SELF = "self"
PAIR = "pair"
_CHUNK = 4 << 20
_ZEROS = bytes(_CHUNK)


def stream_iv(kind: str, label: str, block: int = 0) -> bytes:
    """ChaCha20's 16-byte IV for (kind, tensor label): the 32-bit little-endian block counter (where
    in the stream to start, in 64-byte blocks), then a 96-bit nonce from SHA-256 (length-prefixed
    fields, so no two (kind, label) pairs share it)."""
    k, name = kind.encode(), label.encode()
    digest = hashlib.sha256(b"fedtrain/secagg/mask\0" + len(k).to_bytes(2, "big") + k + name).digest()
    return block.to_bytes(4, "little") + digest[:12]


def mask_stream(
    seed: bytes, kind: str, label: str, numel: int, bits: int, out: np.ndarray | None = None, start: int = 0
) -> np.ndarray:
    """`numel` ring elements of 2^bits from the keystream of (seed, kind, label), beginning at element
    `start` (a multiple of one 64-byte ChaCha20 block), written into `out` (a scratch array of that
    size and ring dtype, reused across masks of one tensor: a fresh large array costs its page
    faults, about as much as the cipher) or a new array."""
    if len(seed) != SEED_BYTES:
        raise PrivacyError(f"a mask seed is {SEED_BYTES} bytes, got {len(seed)}")
    if numel < 0 or bits not in (16, 32):
        raise PrivacyError(f"a mask has numel >= 0 and 16 or 32 bits, got {numel}, {bits}")
    if start < 0 or (start * (bits // 8)) % 64:
        raise PrivacyError(f"a mask stream starts on a 64-byte block, not at element {start}")
    if start + numel > (2**32 * 64) // (bits // 8):  # the 32-bit block counter must not wrap
        raise PrivacyError(f"a tensor of {start + numel} values is too large for one mask stream")
    crypto()
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    iv = stream_iv(kind, label, start * (bits // 8) // 64)
    enc = Cipher(algorithms.ChaCha20(seed, iv), mode=None).encryptor()
    dtype = np.dtype("<u2") if bits == 16 else np.dtype("<u4")
    if out is None:
        out = np.empty(numel, dtype=dtype)
    elif out.dtype != dtype or out.shape != (numel,) or not out.flags.c_contiguous:
        raise PrivacyError(f"a mask's scratch array must be {numel} contiguous {dtype} values")
    raw = out.view(np.uint8)
    view = memoryview(raw.data)
    for off in range(0, raw.size, _CHUNK):
        n = min(_CHUNK, raw.size - off)
        enc.update_into(_ZEROS[:n] if n < _CHUNK else _ZEROS, view[off : off + n])
    return out


def pairing_graph(participants: Collection[int], degree: int | None, public_seed: bytes) -> dict[int, frozenset[int]]:
    """Each participant's neighbours. `degree` None (or ≥ n − 1): everyone (Bonawitz). Else the
    Harary graph H(k, n) — each node joined to the k/2 nearest on each side of a ring — over a
    permutation of the ids drawn from `public_seed`; an odd k is taken as k + 1, so every node has
    exactly k' = min(k + k mod 2, n − 1) neighbours and the graph stays connected."""
    ids = sorted({check_participant_id(p) for p in participants})
    n = len(ids)
    if degree is not None and degree < 2:
        raise PrivacyError(f"a pairing degree is at least 2, got {degree}")
    if degree is None or degree + degree % 2 >= n - 1:
        return {u: frozenset(v for v in ids if v != u) for u in ids}
    if len(public_seed) < 16:
        raise PrivacyError("the pairing graph's public seed must be at least 16 bytes")
    order = list(ids)
    random.Random(hashlib.sha256(b"fedtrain/secagg/graph\0" + public_seed).digest()).shuffle(order)
    half = (degree + degree % 2) // 2
    graph: dict[int, set[int]] = {u: set() for u in ids}
    for i, u in enumerate(order):
        for j in range(1, half + 1):
            v = order[(i + j) % n]
            graph[u].add(v)
            graph[v].add(u)
    return {u: frozenset(vs) for u, vs in graph.items()}


#: One mask term: (seed, kind, +1 to add its stream or −1 to subtract it).
Term = tuple[bytes, str, int]
#: Below this many values a tensor's masks are drawn in the calling thread.
_PARALLEL_MIN = 1 << 20


def apply_masks(target: np.ndarray, terms: Sequence[Term], label: str, bits: int, workers: int = 1,
                offset: int = 0) -> np.ndarray:
    """target ± each term's stream, in place; `target` holds elements [offset, offset + size) of the
    tensor (an FSDP rank's rows, flat), so it takes that slice of each stream. With `workers` > 1
    it is cut into block-aligned ranges drawn in threads (ChaCha20 in `cryptography` and numpy's
    ring additions release the GIL); each range starts its streams at its own block counter, so
    the result is the same. A stream starts only at a 64-byte block: a range that does not begin
    on one draws from the enclosing block and drops the head."""
    if offset < 0:
        raise PrivacyError(f"a mask range starts at element 0 or later, not {offset}")
    size = target.size
    step = 64 // (bits // 8)  # elements per ChaCha20 block
    parts = max(1, min(workers, size // _PARALLEL_MIN))
    # cut points in the tensor's own element numbers, on block boundaries (except the two ends)
    inner = [-(-(offset + size * i // parts) // step) * step for i in range(1, parts)]
    bounds = [offset, *(min(offset + size, b) for b in inner), offset + size]

    def run(lo: int, hi: int) -> None:  # elements [lo, hi) of the tensor
        if hi <= lo:
            return
        head = lo % step  # (only the first range can start off a block)
        scratch = np.empty(hi - lo + head, dtype=target.dtype)
        for seed, kind, sign in terms:
            mask_stream(seed, kind, label, scratch.size, bits, out=scratch, start=lo - head)
            (ring_add if sign > 0 else ring_sub)(target[lo - offset : hi - offset], scratch[head:])

    if parts == 1:
        run(offset, offset + size)
    else:
        with ThreadPoolExecutor(parts) as pool:
            list(pool.map(run, bounds[:-1], bounds[1:]))
    return target


def mask_tensor(
    encoded: np.ndarray,
    label: str,
    me: int,
    self_seed: bytes,
    pair_seeds: Mapping[int, bytes],
    fp: FixedPoint,
    workers: int = 1,
    offset: int = 0,
) -> np.ndarray:
    """`encoded` (ring elements of one tensor, or of its elements [offset, offset + size): a piece)
    plus u's self mask and signed pairwise masks, in place: + PRG(s_uv) where u < v, − where u > v.
    Returns the same array."""
    if encoded.dtype != fp.dtype:
        raise PrivacyError(f"a 2^{fp.bits} ring tensor is {fp.dtype}, got {encoded.dtype}")
    if me in pair_seeds:
        raise PrivacyError(f"participant {me} cannot be paired with itself")
    terms: list[Term] = [(self_seed, SELF, 1)]
    terms += [(pair_seeds[peer], PAIR, 1 if me < peer else -1) for peer in sorted(pair_seeds)]
    return apply_masks(encoded, terms, label, fp.bits, workers, offset)


def check_labels(labels: Sequence[str]) -> None:
    if len(set(labels)) != len(labels):
        raise PrivacyError("tensor labels must be unique within an upload: a repeated label would reuse a mask")
