"""transport/resume.py: what a download keeps between its attempts, and what it accepts as the
rest of its body: a 206 that begins at the byte received, of the same total, under the same
ETag; anything else drops what came (never stitched), and a 200 starts over."""

from __future__ import annotations

import httpx
import pytest
import torch

from fedtrain.errors import WireError
from fedtrain.transport.resume import PartialDownload
from fedtrain.wire import DIGEST_HEADER, EncodedBody

BODY = EncodedBody({"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(10, 10)})
DATA = b"".join(bytes(c) for c in BODY)
ETAG = f'"{BODY.digest()}"'


def whole(etag: str = ETAG, data: bytes = DATA, digest: str = BODY.digest()) -> httpx.Headers:
    return httpx.Headers({"content-length": str(len(data)), DIGEST_HEADER: digest, "etag": etag,
                          "x-fedtrain-version": "3"})


def rest(first: int, total: int = len(DATA), etag: str = ETAG) -> httpx.Headers:
    return httpx.Headers({"content-length": str(total - first), DIGEST_HEADER: BODY.digest(), "etag": etag,
                          "content-range": f"bytes {first}-{total - 1}/{total}"})


def begun(cut: int) -> PartialDownload:
    partial = PartialDownload("download", None, None)
    assert partial.headers() == {}
    partial.start(200, whole()).feed(DATA[:cut])
    with pytest.raises(WireError, match="truncated"):
        partial.finish()
    return partial


def test_the_rest_of_the_body_completes_it() -> None:
    for cut in (3, 100, 2000, len(DATA) - 1):  # in the prefix, the header, the data
        partial = begun(cut)
        assert partial.headers() == {"Range": f"bytes={cut}-", "If-Range": ETAG}
        partial.start(206, rest(cut)).feed(DATA[cut:])
        version, tensors = partial.finish()
        assert version == 3 and torch.equal(tensors["a"], torch.arange(1000, dtype=torch.float32))
        assert partial.resumed == 1 and partial.restarts == 0
        partial.close()


@pytest.mark.parametrize("headers", [rest(999), rest(1001), rest(1000, len(DATA) + 8), rest(1000, etag='"other"'),
                                     httpx.Headers({"content-range": "bytes */5", "etag": ETAG})])
def test_a_206_that_is_not_the_rest_is_never_stitched(headers: httpx.Headers) -> None:
    partial = begun(1000)
    with pytest.raises(WireError):
        partial.start(206, headers)
    assert partial.headers() == {}  # dropped: the next attempt asks for the whole body
    partial.close()


def test_a_200_starts_over_on_the_body_it_brings() -> None:
    other = EncodedBody({"a": torch.zeros(1000), "b": torch.zeros(10, 10)})
    data = b"".join(bytes(c) for c in other)
    partial = begun(1000)
    partial.start(200, whole(f'"{other.digest()}"', data, other.digest())).feed(data)
    _, tensors = partial.finish()
    assert torch.equal(tensors["a"], torch.zeros(1000)) and partial.restarts == 1


def test_a_body_whose_digest_differs_is_dropped_whole() -> None:
    partial = begun(1000)
    spoilt = bytearray(DATA[1000:])
    spoilt[-1] ^= 1
    partial.start(206, rest(1000)).feed(bytes(spoilt))
    with pytest.raises(WireError, match="digest"):
        partial.finish()
    assert partial.headers() == {} and partial.body is None
