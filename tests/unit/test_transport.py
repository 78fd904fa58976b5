"""The transport seam's switch and its version range: `FEDTRAIN_FAST_IO` read as documented, an
explicit `fast_io` winning over it, the tested ranges of the libraries whose internals the
fast paths touch kept in step with pyproject.toml, and the package light to import."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fedtrain.transport import FAST_IO_ENV, allocator, fast_io_enabled, versions
from fedtrain.transport.writers import BufferedWriter, checkpoint_writer
from tests.helpers.imports import heavy_after

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value, on", [("0", False), ("off", False), ("FALSE", False), (" No ", False),
                                       ("1", True), ("on", True), ("yes", True), ("true", True), ("", True),
                                       (None, True)])
def test_the_environment_switches_fast_io(monkeypatch: pytest.MonkeyPatch, value: str | None, on: bool) -> None:
    if value is None:
        monkeypatch.delenv(FAST_IO_ENV, raising=False)
    else:
        monkeypatch.setenv(FAST_IO_ENV, value)
    assert fast_io_enabled() is on
    assert fast_io_enabled(True) is True and fast_io_enabled(False) is False  # an explicit setting wins


def test_the_plain_path_writes_buffered_and_leaves_the_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(allocator, "tune_allocator", lambda: calls.append(1) or True)
    assert isinstance(checkpoint_writer(False), BufferedWriter)
    assert not isinstance(checkpoint_writer(True), BufferedWriter)
    assert allocator.tune_process(False) is False and calls == []
    assert allocator.tune_process(True) is True and calls == [1]
    monkeypatch.setenv(FAST_IO_ENV, "off")
    assert allocator.tune_process() is False and calls == [1]
    assert isinstance(checkpoint_writer(), BufferedWriter)


def test_versions_are_compared_by_release() -> None:
    assert versions.release("0.54.1rc1") == (0, 54, 1)
    assert versions.release("1.0.9") == (1, 0, 9)
    assert versions.release("nonsense") == ()
    assert versions.in_tested_range("uvicorn", "0.54.0") and versions.in_tested_range("uvicorn", "0.54.7")
    for outside in ("0.53.9", "0.55.0", "0.55.0.dev1", "1.0", None):
        assert not versions.in_tested_range("uvicorn", outside), outside
    assert versions.outside_tested("uvicorn", "httptools", "httpcore") == []  # the versions installed here


def _spec(requirement: str) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    m = re.fullmatch(r"([A-Za-z0-9_-]+)(?:\[[^\]]*\])?>=([\d.]+),<([\d.]+)", requirement.replace(" ", ""))
    return (m.group(1), versions.release(m.group(2)), versions.release(m.group(3))) if m else None


def test_pyproject_pins_the_tested_ranges_and_constraints_lie_in_them() -> None:
    text = (ROOT / "pyproject.toml").read_text()  # (no tomllib on Python 3.10)
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    assert block is not None
    deps = re.findall(r'^\s*"([^"]+)"', block.group(1), re.M)
    pinned = {spec[0]: spec[1:] for spec in map(_spec, deps) if spec is not None}
    constraints = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                       if "==" in line and not line.startswith("#"))
    for name, tested in versions.TESTED.items():
        assert pinned.get(name) == tested, f"pyproject.toml's range for {name} is not transport/versions.py's"
        assert versions.in_tested_range(name, constraints[name]), f"constraints.txt pins {name} outside its range"


def test_the_seam_is_light_to_import() -> None:
    assert heavy_after("import fedtrain.transport; fedtrain.transport.fast_io_enabled()") == []
    assert "uvicorn" not in heavy_after("from fedtrain.transport import ServerLimits, READINTO, Body")
