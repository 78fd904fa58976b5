"""The libraries whose internals the fast paths touch, and the range of their versions each
fast path was tested in.

`ReadIntoProtocol` subclasses uvicorn's httptools protocol and drives httptools' parser;
the participant's patch of httpcore (`http_client.py`) reaches into httpcore's HTTP/1.1
connection. `pyproject.toml` pins the same ranges (a test keeps the two in step), raised
only after `bash .ci/latest` passed on the newer releases. Should a library outside its
range be installed anyway, the fast path that touches it steps aside for the plain one,
with one warning: slower, never broken.
"""

from __future__ import annotations

import functools
import logging
import re
from importlib import metadata

__all__ = ["TESTED", "outside_tested", "release"]

log = logging.getLogger("fedtrain.transport")

TESTED: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "uvicorn": ((0, 54), (0, 55)),
    "httptools": ((0, 9), (0, 10)),
    "httpcore": ((1, 0, 9), (1, 1)),
}
"""Per distribution: the lowest release tested, and the first release not tested (excluded)."""


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: "0.54.1rc1" is (0, 54, 1)."""
    match = re.match(r"\d+(\.\d+)*", version.strip())
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def in_tested_range(name: str, version: str | None) -> bool:
    """Whether `version` of distribution `name` lies in its tested range (None: not installed)."""
    if version is None:
        return False
    low, high = TESTED[name]
    return low <= release(version) < high


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def outside_tested(*names: str) -> list[str]:
    """Of the distributions `names`, those installed outside their tested range (or missing),
    as "name version" strings; the first time each is found, it is logged as a warning."""
    found = []
    for name in names:
        version = installed(name)
        if not in_tested_range(name, version):
            found.append(f"{name} {version or '(not installed)'}")
            _warn_once(name, version)
    return found


@functools.cache
def _warn_once(name: str, version: str | None) -> None:
    low, high = (".".join(map(str, v)) for v in TESTED[name])
    log.warning("%s %s is outside the range fedtrain's fast IO was tested with (>=%s,<%s): the fast path "
                "that relies on it is off, the plain one serves (correct, but slower)", name,
                version or "(not installed)", low, high)
