"""The model a participant presents at its join (issue #31): a sync set that is not the run's
model is refused with every difference named, before anything is added to the roster, and
the field's own bounds hold (a 4xx, never a 5xx)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fedtrain.coordinator import BackgroundCoordinator
from tests.helpers.api import assert_error, client
from tests.helpers.config import tiny_config


@pytest.fixture
def coordinator(tmp_path: Path):  # type: ignore[no-untyped-def]
    with BackgroundCoordinator(tmp_path / "state", tiny_config()) as c:
        yield c


def run_model(c: BackgroundCoordinator) -> dict[str, dict[str, Any]]:
    return c.service.model_spec()


def test_the_run_s_own_model_joins(coordinator: BackgroundCoordinator) -> None:
    with client(coordinator) as http:
        r = http.post("/v1/join", json={"name": "a", "model": run_model(coordinator)})
        assert r.status_code == 200, r.text
        assert [p["id"] for p in coordinator.service.status()["participants"]] == ["a"]


def test_a_model_that_differs_is_refused_naming_each_difference_and_leaves_no_row(
        coordinator: BackgroundCoordinator) -> None:
    model = run_model(coordinator)
    [first, second, third, *_] = model
    wrong = dict(model)
    wrong[first] = {**model[first], "shape": [d + 1 for d in model[first]["shape"]]}
    wrong[second] = {**model[second], "dtype": "BF16"}
    del wrong[third]
    wrong["extra.weight"] = {"dtype": "F32", "shape": [2, 2]}
    with client(coordinator) as http:
        err = assert_error(http.post("/v1/join", json={"name": "wide", "model": wrong}), 409, "model_mismatch")
        for name in (first, second, third, "extra.weight"):
            assert name in err["message"], err["message"]
        assert err["details"]["missing"] == [third] and err["details"]["unexpected"] == ["extra.weight"]
        assert coordinator.service.status()["participants"] == []  # no ghost that holds the rounds up
        # the name is free: the same site with the right model joins at once
        assert http.post("/v1/join", json={"name": "wide", "model": model}).status_code == 200


@pytest.mark.parametrize("spec", [
    {"dtype": "F32", "shape": [-1, 3]},  # a negative size
    {"dtype": "F32", "shape": [1] * 9},  # more dimensions than any tensor has here
    {"dtype": "F32", "shape": [2 ** 63]},  # past every bound
    {"dtype": "F32" * 10, "shape": [2]},  # a dtype name longer than any
    {"dtype": "F32"},  # no shape
    {"dtype": "F32", "shape": [2], "more": 1},  # a field the API does not have
])
def test_a_malformed_tensor_spec_is_a_4xx(coordinator: BackgroundCoordinator, spec: dict) -> None:
    with client(coordinator) as http:
        r = http.post("/v1/join", json={"name": "a", "model": {"w": spec}})
        assert r.status_code == 422, r.text
        assert coordinator.service.status()["participants"] == []


def test_an_unknown_dtype_or_a_very_long_name_is_a_mismatch_or_a_4xx(coordinator: BackgroundCoordinator) -> None:
    model = run_model(coordinator)
    name = next(iter(model))
    with client(coordinator) as http:
        odd = {**model, name: {**model[name], "dtype": "X99"}}
        err = assert_error(http.post("/v1/join", json={"name": "a", "model": odd}), 409, "model_mismatch")
        assert "X99" in err["message"]
        long_name = {**model, "n" * 513: {"dtype": "F32", "shape": [1]}}
        assert http.post("/v1/join", json={"name": "a", "model": long_name}).status_code == 422
        many = {f"t{i}": {"dtype": "F32", "shape": [1]} for i in range(100_001)}
        assert 400 <= http.post("/v1/join", json={"name": "a", "model": many}).status_code < 500
        assert coordinator.service.status()["participants"] == []
