"""Which heavy modules (torch, the HTTP stack) a fresh interpreter holds after some code."""

from __future__ import annotations

import json
import subprocess
import sys

#: The HTTP stack, client and server: what the pure parts (merge math, policy, wire) never need.
HTTP_STACK = ("fastapi", "starlette", "uvicorn", "httpx", "httpcore", "httptools")


HEAVY = ("torch", *HTTP_STACK)


def heavy_after(code: str) -> list[str]:
    """The heavy modules a fresh interpreter holds after running `code`."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])
