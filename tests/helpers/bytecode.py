"""Write the test run's bytecode caches once, in the xdist controller, before its workers start.

This machine (and CI, a clone of it) sets PYTHONDONTWRITEBYTECODE=1, so a fresh clone holds no
bytecode for fedtrain or the tests, and nothing writes any: each of the four xdist workers
rewrote the asserts of all ~180 test modules and compiled them and fedtrain again while it
collected, 25 s of CPU per worker in a fresh clone against 15 s with the caches (two cores).
`warm` writes them once: fedtrain's and the helpers' plain `.pyc` files (compileall) and
pytest's assert-rewritten test modules, where pytest looks for them (its own cache format,
keyed by the Python and pytest versions, checked against the source's size and mtime on
every read, so a stale file is never used). Reading a cache needs no permission to write one,
so the workers and every process a test starts read them. They land in `__pycache__`
folders, which git ignores.

pytest's cache writer is private API (pytest is pinned by constraints.txt); if it moves,
`warm` writes nothing and the run is as slow as before, never wrong.
"""

from __future__ import annotations

import compileall
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _test_modules(tests: Path) -> list[Path]:
    return sorted(p for p in tests.rglob("*.py")
                  if (p.name.startswith("test_") or p.name == "conftest.py") and "__pycache__" not in p.parts)


def warm(config: pytest.Config) -> int:
    """Write the caches that are missing or stale, the test modules in two processes (two cores);
    returns how many test modules this process rewrote."""
    import fedtrain

    for package in (Path(fedtrain.__file__).parent, ROOT / "tests" / "helpers"):
        compileall.compile_dir(str(package), quiet=1)
    try:
        from _pytest.assertion import rewrite
        state = config.stash[rewrite.assertstate_key]
    except (ImportError, AttributeError, KeyError):  # (-p no:assertion, or pytest moved its internals)
        return 0
    modules = _test_modules(ROOT / "tests")
    child = os.fork()
    done = 0
    for fn in modules[1::2] if child == 0 else modules[::2]:
        try:
            cache = rewrite.get_cache_dir(fn)
            pyc = cache / (fn.name[:-3] + rewrite.PYC_TAIL)
            if rewrite._read_pyc(fn, pyc) is not None or not rewrite.try_makedirs(cache):
                continue
            source_stat, co = rewrite._rewrite_test(fn, config)
            rewrite._write_pyc(state, co, source_stat, pyc)
            done += 1
        except (AttributeError, TypeError, OSError, SyntaxError):  # the worker's own collection reports it
            continue
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    return done
