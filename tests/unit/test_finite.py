"""The streaming NaN/Inf scan of a body (`wire.finite.FiniteScan`)."""

from __future__ import annotations

import pytest
import torch

from fedtrain.wire import BodyReader, EncodedBody
from fedtrain.wire.finite import FiniteScan

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def body_of(tensors: dict[str, torch.Tensor]) -> tuple[bytes, list]:
    data = b"".join(bytes(c) for c in EncodedBody(tensors))
    reader = BodyReader(store_data=False)
    reader.feed(data)
    reader.finish()
    return data, reader.layout


def scan(data: bytes, layout: list, size: int) -> FiniteScan:
    s = FiniteScan(layout)
    for i in range(0, len(data), size):
        s.feed(data[i : i + size])
    return s


def model(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(37, generator=g).to(dtype),
        "steps": torch.arange(5, dtype=torch.int64),  # not floating: never looked at
        "b": torch.randn(3, 11, generator=g).to(dtype),
        "empty": torch.zeros(0, dtype=dtype),
        "c": torch.randn(2, generator=g).to(dtype),
    }


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [1, 3, 7, 64, 1 << 20])
def test_a_finite_body_passes_whatever_the_chunking(dtype: torch.dtype, size: int) -> None:
    data, layout = body_of(model(dtype))
    s = scan(data, layout, size)
    assert s.complete and s.bad is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize(("name", "index"), [("a", 0), ("a", 36), ("b", 17), ("c", 1)])
@pytest.mark.parametrize("size", [1, 3, 5, 4096])
def test_a_nan_or_inf_is_found_in_its_tensor(dtype: torch.dtype, value: float, name: str, index: int,
                                              size: int) -> None:
    t = model(dtype)
    t[name].view(-1)[index] = value
    data, layout = body_of(t)
    s = scan(data, layout, size)
    assert s.bad == name


def test_the_first_bad_tensor_is_named_and_large_finite_values_pass() -> None:
    t = model(torch.float32)
    t["a"][3] = 3e38  # finite, near the top of the range
    t["b"][0, 0] = float("inf")
    t["c"][0] = float("nan")
    data, layout = body_of(t)
    assert scan(data, layout, 13).bad == "b"
    t["b"][0, 0] = 0.0
    t["c"][0] = 0.0
    assert scan(*body_of(t), 13).bad is None


def test_a_dtype_it_cannot_read_makes_the_scan_incomplete() -> None:
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    data, layout = body_of({"a": torch.ones(4), "q": torch.zeros(8).to(torch.float8_e4m3fn)})
    s = scan(data, layout, 5)
    assert not s.complete and s.bad is None


def test_the_header_can_be_skipped_but_no_value() -> None:
    t = model(torch.float32)
    t["c"][1] = float("nan")
    data, layout = body_of(t)
    first = min(start for _, start in layout)
    s = FiniteScan(layout)
    s.skip(first)  # the header, unread
    for i in range(first, len(data), 5):
        s.feed(data[i : i + 5])
    assert s.bad == "c"
    with pytest.raises(ValueError, match="before the first value"):
        FiniteScan(layout).skip(first + 1)
