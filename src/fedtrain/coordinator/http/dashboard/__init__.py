"""The coordinator's web face: the dashboard page's files and the headers it is served with.

The page is plain HTML, CSS and JavaScript under `static/` (no build step, no CDN: it
works on a machine with no internet). It holds no secret: it asks for a run token, keeps
it in the browser's localStorage and sends it as a bearer token to the same `/v1` API
as every other client, so participant tokens see a read-only dashboard and only the
admin token may change the config or evict. Its routes are in `coordinator/routes/dashboard.py`.
"""

from __future__ import annotations

from pathlib import Path

STATIC_DIR = Path(__file__).parent / "static"

#: The page loads only its own files and talks only to its own origin.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
