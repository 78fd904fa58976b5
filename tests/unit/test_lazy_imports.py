"""The package `__init__`s export lazily (PEP 562): importing a light part of fedtrain does not
pull torch, the HTTP client or the server stack, and every public name still resolves.

Each import is checked in a fresh interpreter, since this one has long loaded everything."""

from __future__ import annotations

import importlib

import pytest

from tests.helpers.imports import HTTP_STACK, heavy_after

PACKAGES = [
    "fedtrain",
    "fedtrain.coordinator",
    "fedtrain.merge",
    "fedtrain.participant",
    "fedtrain.recipes",
    "fedtrain.wire",
    "fedtrain.integrations",
]


@pytest.mark.parametrize(
    "code, allowed",
    [
        ("import fedtrain", ()),
        ("import fedtrain.merge", ()),
        ("import fedtrain.coordinator.policy", ()),
        ("import fedtrain.coordinator.policy.balance", ()),
        ("import fedtrain.coordinator", ()),
        ("import fedtrain.wire", ()),
        ("import fedtrain.wire; fedtrain.wire.DIGEST_HEADER", ()),
        ("import fedtrain.recipes, fedtrain.participant, fedtrain.integrations", ()),
        ("import fedtrain.cli", ()),
        ("from fedtrain import ConfigError, RunConfig, __version__", ()),
        # what the merge math needs, and no more: torch, not the network
        ("from fedtrain.merge import OuterOptimizer", ("torch",)),
    ],
)
def test_light_imports_stay_light(code: str, allowed: tuple[str, ...]) -> None:
    assert set(heavy_after(code)) <= set(allowed)


@pytest.mark.parametrize(
    "code",
    [
        "import fedtrain",
        "import fedtrain.merge",
        "import fedtrain.coordinator.policy",
        "import fedtrain.coordinator.policy.balance",
        "import fedtrain.wire",
        # the names the merge math and the wire format export, once used
        "from fedtrain.merge import OuterOptimizer, RunningSum, weighted_mean",
        "from fedtrain.wire import EncodedBody, read_tensors, write_file",
        "from fedtrain.coordinator.policy import decide_round",
    ],
)
def test_pure_parts_pull_no_http_stack(code: str) -> None:
    assert [m for m in heavy_after(code) if m in HTTP_STACK] == [], f"{code!r} loads the HTTP stack"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
        assert name in dir(module), name
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018


def test_public_names_are_the_classes_themselves() -> None:
    import fedtrain
    from fedtrain.participant.client import retry  # a submodule, not an export: still importable
    from fedtrain.participant.engine.participant import Participant

    assert fedtrain.Participant is Participant
    from fedtrain import Participant as again

    assert again is Participant
    assert retry.__name__ == "fedtrain.participant.client.retry"
