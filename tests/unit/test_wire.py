"""Streamed safetensors bodies: round trips, compatibility with safetensors, and refusals."""

from __future__ import annotations

import asyncio
import json
import os
import random
import struct
from collections.abc import AsyncIterator

import numpy as np
import pytest
import safetensors.torch as st
import torch

from fedtrain.errors import WireError
from fedtrain.wire import (
    DIGEST_HEADER,
    DTYPE_TO_ST,
    ST_TO_DTYPE,
    BodyReader,
    EncodedBody,
    TensorSpec,
    aread_tensors,
    digest_bytes,
    digest_chunks,
    iter_file,
    parse_digest,
    read_tensors,
    spec_of,
    write_file,
)


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    hi = min(info.max, 1 << 30)
    return torch.randint(max(info.min, -hi), hi, shape, generator=g, dtype=torch.int64).to(dtype)


def _mixed() -> dict[str, torch.Tensor]:
    tensors = {f"t_{st_name}": _sample(dtype, (3, 5), i) for i, (st_name, dtype) in enumerate(ST_TO_DTYPE.items())}
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.bfloat16)
    tensors["empty"] = torch.zeros(0, 4)
    tensors["empty_after"] = torch.zeros(2, 0, dtype=torch.int8)
    tensors["transposed"] = torch.randn(4, 6).t()
    tensors["strided"] = torch.arange(40, dtype=torch.int32)[::3]
    tensors["big"] = torch.randn(1000)
    return tensors


def _body(tensors: dict[str, torch.Tensor], **kw: object) -> bytes:
    return b"".join(EncodedBody(tensors, **kw))  # type: ignore[arg-type]


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert got[name].shape == t.shape, name
        assert torch.equal(_bytes(got[name]), _bytes(t)), name


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _raw(header: dict, data: bytes = b"", pad: bool = True) -> bytes:
    raw = json.dumps(header).encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


# ---- round trips and compatibility ----------------------------------------------------------


def test_dtype_maps_cover_the_required_dtypes() -> None:
    for name in ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL"]:
        assert DTYPE_TO_ST[ST_TO_DTYPE[name]] == name
    assert ST_TO_DTYPE["F8_E4M3"] == torch.float8_e4m3fn


def test_round_trip_many_dtypes_scalars_empty_and_non_contiguous() -> None:
    tensors = _mixed()
    body = EncodedBody(tensors, {"round": "3"}, chunk_size=7)
    data = b"".join(body)
    assert len(data) == body.content_length
    assert data.startswith(body.header) and len(body.header) % 8 == 0
    reader = BodyReader(expected_digest=body.digest(), expected_length=len(data))
    got = dict(reader.feed(data))
    reader.finish()
    _assert_same(got, tensors)
    assert reader.done and reader.metadata == {"round": "3"}
    assert reader.specs == spec_of(tensors)


def test_safetensors_loads_our_bodies_and_files() -> None:
    tensors = _mixed()
    loaded = st.load(_body(tensors, metadata={"a": "b"}))
    _assert_same({k: loaded[k] for k in tensors}, tensors)


def test_reader_parses_bodies_written_by_safetensors() -> None:
    tensors = {k: v.contiguous() for k, v in _mixed().items()}
    data = st.save(tensors, metadata={"format": "pt"})
    reader = BodyReader(expected_digest=digest_bytes(data))
    got = dict(reader.feed(data))
    reader.finish()
    _assert_same({k: got[k] for k in tensors}, tensors)
    assert reader.metadata == {"format": "pt"}


@pytest.mark.parametrize("mode", ["one_byte", "random"])
def test_feeding_in_small_and_random_chunks(mode: str) -> None:
    tensors = _mixed()
    body = EncodedBody(tensors)
    data = b"".join(body)
    rng = random.Random(7)
    reader = BodyReader(expected_digest=body.digest())
    got: list[tuple[str, torch.Tensor]] = []
    pos = 0
    while pos < len(data):
        step = 1 if mode == "one_byte" else rng.choice([1, 2, 3, 8, 13, 64, 500, 4096])
        chunk = bytearray(data[pos : pos + step])
        got += reader.feed(memoryview(chunk))
        chunk[:] = b"\xff" * len(chunk)  # the reader must not keep the caller's buffer
        pos += step
    reader.finish()
    _assert_same(dict(got), tensors)
    assert reader.bytes_received == len(data)


def test_encoded_body_is_reiterable_and_digest_is_cached() -> None:
    body = EncodedBody({"w": torch.randn(100)}, chunk_size=64)
    first, second = b"".join(body), b"".join(body)
    assert first == second
    assert body.digest() == digest_bytes(first) == digest_chunks(body)
    assert parse_digest(body.digest())[0] == "xxh3-128"  # the default
    assert all(len(c) <= 64 for c in list(body)[1:])


@pytest.mark.parametrize("algorithm", ["xxh3-128", "sha256"])
def test_each_digest_algorithm_is_checked_by_its_name(algorithm: str) -> None:
    import hashlib

    import xxhash

    tensors = {"w": torch.randn(1000), "b": torch.arange(5)}
    body = EncodedBody(tensors, digest_algorithm=algorithm)
    data = b"".join(body)
    reference = {"sha256": hashlib.sha256, "xxh3-128": xxhash.xxh3_128}[algorithm](data).hexdigest()
    assert body.digest() == f"{algorithm}:{reference}" == digest_bytes(data, algorithm)
    _assert_same(dict(read_tensors([data], expected_digest=body.digest())), tensors)  # the reader follows the name
    other = "sha256" if algorithm == "xxh3-128" else "xxh3-128"
    assert parse_digest(digest_bytes(data, other))[0] == other
    bad = bytearray(data)
    bad[-3] ^= 0x40
    with pytest.raises(WireError, match=f"body digest mismatch: expected {algorithm}:"):
        list(read_tensors([bytes(bad)], expected_digest=body.digest()))


def test_encoded_body_chunks_share_memory_with_the_tensors() -> None:
    base = torch.randn(10_000)
    w = base[100:5100]  # contiguous, with a storage offset
    chunks = list(EncodedBody({"w": w}, chunk_size=4096))[1:]
    lo, hi = w.data_ptr(), w.data_ptr() + w.numel() * w.element_size()
    covered = 0
    for chunk in chunks:
        arr = np.frombuffer(chunk, dtype=np.uint8)
        assert np.shares_memory(arr, w.numpy())
        assert lo <= arr.ctypes.data and arr.ctypes.data + arr.nbytes <= hi
        covered += arr.nbytes
    assert covered == hi - lo


def test_parameters_with_grad_and_bf16_encode() -> None:
    p = torch.nn.Parameter(torch.randn(8, 8).to(torch.bfloat16))
    got = dict(read_tensors(EncodedBody({"p": p})))
    assert torch.equal(got["p"], p.detach())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_copied_to_cpu_one_at_a_time() -> None:
    tensors = {"a": torch.randn(64, 32, device="cuda").t(), "b": torch.arange(9, device="cuda")}
    got = dict(read_tensors(EncodedBody(tensors, chunk_size=100)))
    for name, t in tensors.items():
        assert torch.equal(got[name], t.cpu())


def test_async_reader() -> None:
    tensors = _mixed()
    body = EncodedBody(tensors, chunk_size=100)

    async def main() -> dict[str, torch.Tensor]:
        return {name: t async for name, t in aread_tensors(body.aiter_chunks(), expected_digest=body.digest())}

    _assert_same(asyncio.run(main()), tensors)


def test_async_reader_refuses_truncation() -> None:
    data = _body({"w": torch.randn(100)})

    async def chunks() -> AsyncIterator[bytes]:
        yield data[:-3]

    async def main() -> None:
        async for _ in aread_tensors(chunks()):
            pass

    with pytest.raises(WireError, match="truncated"):
        asyncio.run(main())


def test_write_file_is_atomic_and_loadable(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "global_r3.safetensors")
    tensors = _mixed()
    digest = write_file(path, tensors, {"round": "3"})
    assert os.listdir(str(tmp_path)) == ["global_r3.safetensors"]
    assert digest == digest_chunks(iter_file(path, chunk_size=33))
    loaded = st.load_file(path)
    _assert_same({k: loaded[k] for k in tensors}, tensors)
    got = dict(read_tensors(iter_file(path), expected_digest=digest))
    _assert_same(got, tensors)


def test_allocate_writes_into_the_provided_tensors() -> None:
    src = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64)}
    dest = {"a": torch.nn.Parameter(torch.zeros(3, 4)), "b": torch.zeros(5, dtype=torch.int64)}
    ptrs = {k: v.data_ptr() for k, v in dest.items()}
    got = dict(read_tensors(EncodedBody(src), allocate=lambda s: dest[s.name]))
    for k, want in src.items():
        assert got[k] is dest[k] and dest[k].data_ptr() == ptrs[k]
        assert torch.equal(dest[k], want)


@pytest.mark.parametrize(
    "bad",
    [
        lambda s: torch.zeros(4, 3),
        lambda s: torch.zeros(3, 4, dtype=torch.float64),
        lambda s: torch.zeros(4, 3).t(),
        lambda s: "not a tensor",
    ],
)
def test_allocate_must_match_the_spec(bad: object) -> None:
    with pytest.raises(WireError, match="allocate"):
        list(read_tensors(EncodedBody({"a": torch.randn(3, 4)}), allocate=bad))  # type: ignore


def test_on_header_runs_before_any_data_and_can_stop_the_read() -> None:
    data = _body({"a": torch.randn(10), "b": torch.randn(10)})
    seen: list[dict[str, TensorSpec]] = []

    def on_header(specs: dict[str, TensorSpec], metadata: dict[str, str]) -> None:
        seen.append(specs)
        raise ValueError("unexpected key 'b'")

    def alloc(spec: TensorSpec) -> torch.Tensor:
        raise AssertionError("no tensor may be allocated")

    reader = BodyReader(on_header=on_header, allocate=alloc)
    with pytest.raises(ValueError, match="unexpected key"):
        reader.feed(data)
    assert list(seen[0]) == ["a", "b"] and seen[0]["a"].shape == (10,)
    with pytest.raises(WireError, match="already refused"):
        reader.feed(b"x")


# ---- refusals ---------------------------------------------------------------------------------


def test_flipped_data_byte_fails_the_digest() -> None:
    body = EncodedBody({"w": torch.randn(64)}, {"note": "abc"})
    data = bytearray(b"".join(body))
    data[-5] ^= 0x01
    reader = BodyReader(expected_digest=body.digest())
    reader.feed(data)
    with pytest.raises(WireError, match="body digest mismatch: expected xxh3-128:"):
        reader.finish()


def test_flipped_header_byte_fails_the_digest() -> None:
    body = EncodedBody({"w": torch.randn(64)}, {"note": "abc"})
    data = b"".join(body).replace(b'"abc"', b'"abd"')
    reader = BodyReader(expected_digest=body.digest())
    reader.feed(data)
    assert reader.metadata == {"note": "abd"}
    with pytest.raises(WireError, match="digest mismatch"):
        reader.finish()


@pytest.mark.parametrize("cut", [0, 3, 8, 20, -401, -1])
def test_truncated_bodies_are_refused(cut: int) -> None:
    data = _body({"w": torch.randn(100)}, metadata={"k": "v"})
    end = cut if cut >= 0 else len(data) + cut
    reader = BodyReader()
    reader.feed(data[:end])
    with pytest.raises(WireError, match=rf"truncated: expected .*received {end}"):
        reader.finish()


def test_trailing_bytes_are_refused() -> None:
    data = _body({"w": torch.randn(10)})
    with pytest.raises(WireError, match="trailing bytes"):
        BodyReader().feed(data + b"\0")
    reader = BodyReader()
    reader.feed(data)
    with pytest.raises(WireError, match="trailing bytes"):
        reader.feed(b"\0")


def _f32(offsets: list[int], shape: list[int] | None = None) -> dict:
    return {
        "dtype": "F32",
        "shape": shape or [(offsets[1] - offsets[0]) // 4],
        "data_offsets": offsets,
    }


@pytest.mark.parametrize(
    "body, message",
    [
        (struct.pack("<Q", 9) + b"{not json", "not valid JSON"),
        (struct.pack("<Q", 8) + b"\xff\xfe{}    ", "UTF-8"),
        (_raw([1, 2]), "JSON object"),  # type: ignore[arg-type]
        (
            _raw({"w": {"dtype": "C128", "shape": [1], "data_offsets": [0, 16]}}, b"\0" * 16),
            "unknown dtype",
        ),
        (
            _raw({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
            "invalid shape",
        ),
        (
            _raw({"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, b"\0" * 4),
            "invalid shape",
        ),
        (
            _raw({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
            "needs 8 bytes",
        ),
        (
            _raw({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4),
            "invalid data_offsets",
        ),
        (_raw({"a": _f32([0, 8]), "b": _f32([4, 12])}, b"\0" * 12), "overlap"),
        (_raw({"a": _f32([0, 8]), "b": _f32([12, 16])}, b"\0" * 16), "gap"),
        (_raw({"a": _f32([4, 8])}, b"\0" * 8), "gap"),
        (_raw({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4), "exactly"),
        (_raw({"__metadata__": {"k": 1}}), "strings to strings"),
        (_raw({"__metadata__": []}), "strings to strings"),
        (struct.pack("<Q", 1 << 40) + b"{}", "header length"),
        (struct.pack("<Q", 0), "header length is 0"),
        (struct.pack("<Q", 16) + b'{"a":1, "a":2}  ', "twice"),
    ],
)
def test_malformed_headers_are_refused(body: bytes, message: str) -> None:
    with pytest.raises(WireError, match=message):
        BodyReader().feed(body)


def test_a_lying_header_allocates_nothing_before_data_arrives() -> None:
    huge = {"w": {"dtype": "F32", "shape": [1 << 60], "data_offsets": [0, 1 << 62]}}
    reader = BodyReader()
    reader.feed(_raw(huge))  # header only: nothing allocated yet
    assert reader.specs is not None and reader.specs["w"].nbytes == 1 << 62
    with pytest.raises(WireError, match="cannot allocate tensor 'w'"):
        reader.feed(b"\0")
    with pytest.raises(WireError, match="2\\*\\*63"):
        BodyReader().feed(_raw({"w": {"dtype": "U8", "shape": [0, 10**30], "data_offsets": [0, 0]}}))


def test_max_bytes_limit() -> None:
    data = _body({"w": torch.randn(1000)})
    with pytest.raises(WireError, match=r"limit of 1000 bytes"):
        BodyReader(max_bytes=1000).feed(data[:200])  # refused from the header alone
    with pytest.raises(WireError, match="limit of 64 bytes"):
        BodyReader(max_bytes=64).feed(data)
    assert len(dict(read_tensors([data], max_bytes=len(data)))) == 1


def test_expected_length_must_match_the_header() -> None:
    data = _body({"w": torch.randn(10)})
    with pytest.raises(WireError, match="declared body length"):
        BodyReader(expected_length=len(data) + 1).feed(data)
    with pytest.raises(WireError, match="declared length"):
        BodyReader(expected_length=len(data) - 1).feed(data)


def test_bad_expected_digest_and_unsupported_inputs() -> None:
    with pytest.raises(WireError, match="unsupported digest algorithm"):
        BodyReader(expected_digest="md5:" + "0" * 32)
    with pytest.raises(WireError, match="malformed"):
        parse_digest("sha256:xyz")
    with pytest.raises(WireError, match="xxh3-128 needs 32 hex digits"):
        parse_digest("xxh3-128:" + "0" * 64)
    with pytest.raises(WireError, match="unsupported digest algorithm"):
        EncodedBody({"a": torch.zeros(1)}, digest_algorithm="md5")
    with pytest.raises(WireError, match="complex128"):
        EncodedBody({"c": torch.zeros(2, dtype=torch.complex128)})
    with pytest.raises(WireError, match="strings to strings"):
        EncodedBody({"a": torch.zeros(1)}, {"k": 1})  # type: ignore[dict-item]
    with pytest.raises(WireError, match="__metadata__"):
        EncodedBody({"__metadata__": torch.zeros(1)})
    assert DIGEST_HEADER == "X-Fedtrain-Digest"


def test_check_only_reader_keeps_no_data_but_still_checks() -> None:
    tensors = {"a": torch.randn(100), "b": torch.zeros(0), "c": torch.arange(7)}
    body = EncodedBody(tensors)
    raw = b"".join(bytes(c) for c in body)
    reader = BodyReader(expected_digest=body.digest(), store_data=False)
    out = []
    for i in range(0, len(raw), 13):
        out += reader.feed(raw[i : i + 13])
    reader.finish()
    assert out == [] and reader.done and set(reader.specs or {}) == {"a", "b", "c"}
    short = BodyReader(expected_digest=body.digest(), store_data=False)
    short.feed(raw[:-5])
    with pytest.raises(WireError, match="expected"):
        short.finish()
    bad = bytearray(raw)
    bad[-1] ^= 1
    flipped = BodyReader(expected_digest=body.digest(), store_data=False)
    flipped.feed(bytes(bad))
    with pytest.raises(WireError, match="digest mismatch"):
        flipped.finish()


def test_reading_straight_into_the_tensors_matches_feed() -> None:
    """`head_needed` + `writable`/`wrote`, as the participant's socket download drives them."""
    rng = random.Random(7)
    tensors = {"a": torch.randn(3000), "e": torch.empty(0), "b": torch.arange(17, dtype=torch.int32),
               "c": torch.randn(5, 7).to(torch.bfloat16)}
    body = EncodedBody(tensors, {"k": "v"})
    data = b"".join(bytes(c) for c in body)
    reader = BodyReader(expected_digest=body.digest(), expected_length=len(data))
    out: dict[str, torch.Tensor] = {}
    pos = 0
    assert reader.writable() is None and reader.head_needed == 8
    while not reader.done:
        region = reader.writable()
        if region is None:
            n = reader.head_needed
            out.update(reader.feed(data[pos : pos + n]))
        else:
            n = min(region.nbytes, rng.randint(1, 5000))
            region[:n] = data[pos : pos + n]
            out.update(reader.wrote(n))
        pos += n
    reader.finish()
    assert pos == len(data) and reader.head_needed == 0 and list(out) == list(tensors)
    for name, t in tensors.items():
        assert torch.equal(out[name], t)


def test_wrote_refuses_more_than_the_region_and_a_wrong_digest() -> None:
    body = EncodedBody({"a": torch.randn(10)})
    data = b"".join(bytes(c) for c in body)
    reader = BodyReader()
    reader.feed(data[:8])
    reader.feed(data[8 : 8 + reader.head_needed])
    region = reader.writable()
    assert region is not None and region.nbytes == 40
    with pytest.raises(WireError, match="does not fit"):
        reader.wrote(41)
    with pytest.raises(WireError, match="already refused"):
        reader.wrote(1)

    bad = BodyReader(expected_digest=EncodedBody({"a": torch.zeros(10)}).digest())
    bad.feed(data[: len(data) - 40])
    region = bad.writable()
    assert region is not None
    region[:] = data[-40:]
    bad.wrote(40)
    with pytest.raises(WireError, match="digest"):
        bad.finish()
