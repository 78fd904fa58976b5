"""Which HTTP server for the coordinator: uvicorn (httptools) + Starlette/FastAPI vs aiohttp.

    python benchmarks/server_choice.py            # 400 MB bodies, best of 3
    python benchmarks/server_choice.py --quick    # 100 MB bodies, ~30 s

Both servers run in their own subprocess on 127.0.0.1 and are stopped at the end; the
client is httpx sending `EncodedBody` in 1 MiB chunks (the participant's path) and
streaming downloads with `iter_raw`. Figures are MB/s (1 MB = 1e6 bytes) and the ratio to
a raw loopback TCP copy of the same bytes measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import httpx
import torch

from fedtrain.wire import EncodedBody, write_file

HOST = "127.0.0.1"
CHUNK = 1 << 20


def serve_uvicorn(port: int, blob: str) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    async def upload(request: Request) -> JSONResponse:
        n = 0
        async for chunk in request.stream():
            n += len(chunk)
        return JSONResponse({"bytes": n})

    async def download(request: Request) -> StreamingResponse:
        def body() -> Iterator[bytes]:
            with open(blob, "rb") as f:
                while chunk := f.read(4 << 20):
                    yield chunk

        size = os.path.getsize(blob)
        return StreamingResponse(body(), headers={"Content-Length": str(size)})

    async def health(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/up", upload, methods=["POST"]), Route("/down", download),
                            Route("/health", health)])
    uvicorn.run(app, host=HOST, port=port, http="httptools", log_level="error", access_log=False)


def serve_aiohttp(port: int, blob: str) -> None:
    from aiohttp import web

    async def upload(request: web.Request) -> web.Response:
        n = 0
        async for chunk in request.content.iter_chunked(CHUNK):
            n += len(chunk)
        return web.json_response({"bytes": n})

    async def download(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Length": str(os.path.getsize(blob))})
        await resp.prepare(request)
        with open(blob, "rb") as f:
            while chunk := f.read(4 << 20):
                await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=1 << 40)
    app.add_routes([web.post("/up", upload), web.get("/down", download), web.get("/health", health)])
    web.run_app(app, host=HOST, port=port, print=None, access_log=None)


def serve_raw(port: int, blob: str) -> None:
    with socket.create_server((HOST, port)) as srv:
        buf = bytearray(CHUNK)
        while True:
            conn, _ = srv.accept()
            with conn:
                while conn.recv_into(buf):
                    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(kind: str, blob: str) -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port), "--blob", blob])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection((HOST, port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"{kind} server did not start") from None
                time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--mb", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--serve", choices=["uvicorn", "aiohttp", "raw"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--blob", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        {"uvicorn": serve_uvicorn, "aiohttp": serve_aiohttp, "raw": serve_raw}[args.serve](args.port, args.blob)
        return
    mb = args.mb or (100 if args.quick else 400)
    tensors = {f"t{i}": torch.randn(mb * 1_000_000 // 4 // 8) for i in range(8)}
    body = EncodedBody(tensors, chunk_size=CHUNK)
    size = body.content_length
    with tempfile.TemporaryDirectory() as tmp:
        blob = os.path.join(tmp, "model.safetensors")
        write_file(blob, tensors)
        rows: list[tuple[str, float]] = []
        with server("raw", blob) as port:

            def raw() -> None:
                with socket.create_connection((HOST, port)) as s:
                    for chunk in body:
                        s.sendall(chunk)

            rows.append(("raw TCP copy (reference)", best_of(args.repeat, raw)))
        for kind in ("uvicorn", "aiohttp"):
            with server(kind, blob) as port, httpx.Client(base_url=f"http://{HOST}:{port}", timeout=120) as client:

                def up() -> None:
                    r = client.post("/up", content=iter(body), headers={"Content-Length": str(size)})  # type: ignore[arg-type]
                    assert r.json()["bytes"] == size

                def down() -> None:
                    with client.stream("GET", "/down") as r:
                        n = sum(len(c) for c in r.iter_raw(CHUNK))
                    assert n == os.path.getsize(blob)

                rows.append((f"{kind}: upload (httpx, 1 MiB chunks)", best_of(args.repeat, up)))
                rows.append((f"{kind}: download (iter_raw)", best_of(args.repeat, down)))
    raw_s = rows[0][1]
    print(f"body: {size / 1e6:.0f} MB, best of {args.repeat}")
    print(f"{'path':42s} {'MB/s':>8s} {'x raw':>6s}")
    for name, seconds in rows:
        print(f"{name:42s} {size / seconds / 1e6:8.0f} {raw_s / seconds:6.2f}")


if __name__ == "__main__":
    main()
