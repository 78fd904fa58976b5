"""Throughput of tensor bodies: encoding, hashing, parsing, and loopback HTTP vs raw TCP.

    python benchmarks/wire_throughput.py            # ~400 MB of fp32 tensors
    python benchmarks/wire_throughput.py --quick    # ~30 s
    python benchmarks/wire_throughput.py --mb 1000 --tensors 16

Servers (uvicorn with httptools + starlette, and a raw TCP sink) run in subprocesses bound
to free ports on 127.0.0.1, so client and server each get their own core and GIL; they are
stopped at the end. Every figure is the best of --repeat runs, in MB/s (1 MB = 1e6 bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial

import httpx
import safetensors.torch as st
import torch

from fedtrain.wire import DIGEST_HEADER, BodyReader, EncodedBody

HOST = "127.0.0.1"


# ---- servers (run in a subprocess) -----------------------------------------------------------


def serve_http() -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse
    from starlette.routing import Route

    async def discard(request: Request) -> JSONResponse:
        n = 0
        async for chunk in request.stream():
            n += len(chunk)
        return JSONResponse({"bytes": n})

    async def read(request: Request) -> JSONResponse:
        reader = BodyReader(
            expected_digest=request.headers.get(DIGEST_HEADER),
            expected_length=int(request.headers["content-length"]),
        )
        async for chunk in request.stream():
            reader.feed(chunk)
        reader.finish()
        return JSONResponse({"bytes": reader.bytes_received})

    async def health(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(
        routes=[
            Route("/discard", discard, methods=["POST"]),
            Route("/read", read, methods=["POST"]),
            Route("/health", health),
        ]
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, 0))
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app, http="httptools", lifespan="off", log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


def serve_raw() -> None:
    """Accept connections; each sends an 8-byte length and that many bytes; answer b'ok'."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind((HOST, 0))
    srv.listen()
    print(srv.getsockname()[1], flush=True)
    buf = memoryview(bytearray(4 << 20))
    while True:
        conn, _ = srv.accept()
        with conn:
            header = conn.recv(8, socket.MSG_WAITALL)
            left = int.from_bytes(header, "little")
            while left:
                n = conn.recv_into(buf, min(left, len(buf)))
                if n == 0:
                    break
                left -= n
            conn.sendall(b"ok")


@contextlib.contextmanager
def subprocess_server(mode: str) -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, __file__, mode], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- measurements -------------------------------------------------------------------------------


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def make_tensors(mb: int, count: int) -> dict[str, torch.Tensor]:
    per = mb * 1_000_000 // 4 // count
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(count)}


def feed_all(data: bytes, chunk: int, digest: str | None, into: dict[str, torch.Tensor] | None = None) -> None:
    """Parse `data` in chunks; with `into`, write into those tensors instead of new ones."""
    reader = BodyReader(expected_digest=digest, allocate=None if into is None else (lambda s: into[s.name]))
    view = memoryview(data)
    for start in range(0, len(view), chunk):
        reader.feed(view[start : start + chunk])
    reader.finish()


def raw_send(port: int, body: EncodedBody) -> None:
    with socket.create_connection((HOST, port)) as sock:
        sock.sendall(body.content_length.to_bytes(8, "little"))
        for chunk in body:
            sock.sendall(chunk)
        assert sock.recv(2, socket.MSG_WAITALL) == b"ok"


def post(client: httpx.Client, url: str, content: object, length: int, digest: str) -> None:
    headers = {"Content-Length": str(length), DIGEST_HEADER: digest}
    r = client.post(url, content=content, headers=headers)  # type: ignore[arg-type]
    r.raise_for_status()
    assert r.json()["bytes"] == length, r.text


async def best_async_post(url: str, body: EncodedBody, repeat: int) -> float:
    headers = {"Content-Length": str(body.content_length), DIGEST_HEADER: body.digest()}
    best = float("inf")
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), trust_env=False) as client:
        for _ in range(repeat + 1):  # the first run opens the connection
            t0 = time.perf_counter()
            chunks = body.aiter_chunks()  # memoryviews: httpx's bytes-only hint is too narrow
            r = await client.post(url, content=chunks, headers=headers)  # type: ignore[arg-type]
            r.raise_for_status()
            best = min(best, time.perf_counter() - t0)
    return best


def wait_ready(client: httpx.Client, base: str) -> None:
    for _ in range(200):
        with contextlib.suppress(httpx.TransportError):
            if client.get(f"{base}/health").status_code == 200:
                return
        time.sleep(0.05)
    raise RuntimeError("the benchmark HTTP server did not start")


def run(args: argparse.Namespace) -> list[tuple[str, float]]:
    tensors = make_tensors(args.mb, args.tensors)
    body = EncodedBody(tensors)
    data = b"".join(body)
    digest = body.digest()
    size = len(data)
    rows: list[tuple[str, float]] = []

    def add(name: str, seconds: float) -> None:
        rows.append((name, size / seconds / 1e6))
        print(f"  {name:<60} {rows[-1][1]:>9.0f} MB/s", flush=True)

    r = args.repeat
    print(f"body: {size / 1e6:.0f} MB in {len(tensors)} fp32 tensors; best of {r}", flush=True)
    add("safetensors.torch.save() -> bytes", best_of(r, lambda: st.save(tensors)))
    add("safetensors.torch.load(bytes)", best_of(r, lambda: st.load(data)))
    add("EncodedBody iteration (no hash; views only)", best_of(r, lambda: sum(map(len, body))))
    add("EncodedBody iteration + sha256", best_of(r, lambda: EncodedBody(tensors).digest()))
    add(
        "BodyReader.feed 1 MiB chunks (no digest)",
        best_of(r, lambda: feed_all(data, 1 << 20, None)),
    )
    add("BodyReader.feed 1 MiB chunks + sha256", best_of(r, lambda: feed_all(data, 1 << 20, digest)))
    into = {k: torch.empty_like(v) for k, v in tensors.items()}
    add(
        "BodyReader.feed 1 MiB chunks, allocate=preallocated",
        best_of(r, partial(feed_all, data, 1 << 20, None, into)),
    )

    with subprocess_server("--serve-raw") as port:
        raw_body = EncodedBody(tensors, chunk_size=1 << 20)
        raw_send(port, raw_body)
        add(
            "raw TCP sendall(1 MiB memoryviews) -> recv_into",
            best_of(r, lambda: raw_send(port, raw_body)),
        )

    with (
        subprocess_server("--serve-http") as port,
        httpx.Client(timeout=httpx.Timeout(300.0), trust_env=False) as client,
    ):
        base = f"http://{HOST}:{port}"
        wait_ready(client, base)
        for route in ("discard", "read"):
            url = f"{base}/{route}"
            small = EncodedBody({"w": torch.zeros(1000)})
            post(client, url, small, small.content_length, small.digest())  # warm up
            add(
                f"httpx POST content=bytes -> {route}",
                best_of(r, partial(post, client, url, data, size, digest)),
            )
            for cs in (64 << 10, 1 << 20, 4 << 20):
                chunked = EncodedBody(tensors, chunk_size=cs)
                add(
                    f"httpx POST content=EncodedBody({cs >> 10} KiB) -> {route}",
                    best_of(r, partial(post, client, url, chunked, size, digest)),
                )
            add(
                f"httpx.AsyncClient content=aiter_chunks(1024 KiB) -> {route}",
                asyncio.run(best_async_post(url, body, r)),
            )
    return rows


def print_table(rows: list[tuple[str, float]]) -> None:
    raw = next(v for name, v in rows if name.startswith("raw TCP"))
    print(f"\n| {'measure':<60} | {'MB/s':>7} | {'vs raw TCP':>10} |")
    print(f"|{'-' * 62}|{'-' * 9}|{'-' * 12}|")
    for name, value in rows:
        print(f"| {name:<60} | {value:>7.0f} | {value / raw:>10.2f} |")


def main() -> None:
    if len(sys.argv) == 2 and sys.argv[1] in ("--serve-http", "--serve-raw"):
        serve_http() if sys.argv[1] == "--serve-http" else serve_raw()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller body, about 30 s in all")
    parser.add_argument("--mb", type=int, default=None, help="body size in MB (default 400)")
    parser.add_argument("--tensors", type=int, default=8, help="number of tensors")
    parser.add_argument("--repeat", type=int, default=None, help="runs per figure (best kept)")
    args = parser.parse_args()
    args.mb = args.mb or (100 if args.quick else 400)
    args.repeat = args.repeat or 3
    torch.set_num_threads(1)
    print_table(run(args))


if __name__ == "__main__":
    main()
