"""The processes benchmarks/links.py starts inside a namespace: a participant of a real run (the
public `Participant` API, a model of K fp32 tensors, a trivial training step so that compute does
not count), and the raw TCP sink and source of the baseline. Each prints JSON lines on stdout.

    python link_worker.py participant --url URL --token T --name p0 --params 25e6 --tensors 8
    python link_worker.py sink --port 5201 --streams 4
    python link_worker.py source --host 10.0.0.1 --port 5201 --streams 4 --bytes 1e8

It imports only fedtrain's public API, so it runs against any checkout (PYTHONPATH=that/src).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def participant(args: argparse.Namespace) -> None:
    import torch
    from torch import nn

    from fedtrain import Participant

    torch.set_num_threads(1)
    per = int(args.params) // args.tensors

    class Blob(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.ParameterList([nn.Parameter(torch.zeros(per)) for _ in range(args.tensors)])

    model = Blob()
    t0 = time.time()
    with Participant(args.url, token=args.token, model=model, name=args.name) as fed:
        say(event="joined", t=time.time(), seconds=time.time() - t0)
        while not fed.finished:
            r = fed.round
            with torch.no_grad():  # the training step: one element per tensor, so compute is nil
                for p in model.w:
                    p[0] += 1e-3
            synced = len(fed.history)
            say(event="begin", round=r, t=time.time(), cpu=time.process_time())
            t = time.perf_counter()
            fed.step(tokens=1000, loss=1.0)
            step_s = time.perf_counter() - t
            if len(fed.history) > synced:
                h = fed.history[-1]
                say(event="end", round=r, t=time.time(), cpu=time.process_time(), step_s=step_s, sync_s=h.get("sync_s"),
                    bytes_up=h.get("bytes_up"), bytes_down=h.get("bytes_down"))
    say(event="done", t=time.time())


def sink(args: argparse.Namespace) -> None:
    """Accept `streams` connections, read them to their end; say the bytes and the seconds from
    the first accept to the last byte."""
    srv = socket.create_server(("0.0.0.0", args.port), backlog=64)
    say(event="listening")
    total = [0]
    first: list[float] = []
    last = [0.0]
    lock = threading.Lock()

    def drain(conn: socket.socket) -> None:
        buf = bytearray(1 << 20)
        n = 0
        with conn:
            while (k := conn.recv_into(buf)) > 0:
                n += k
        with lock:
            total[0] += n
            last[0] = max(last[0], time.perf_counter())

    threads = []
    for _ in range(args.streams):
        conn, _ = srv.accept()
        if not first:
            first.append(time.perf_counter())
        t = threading.Thread(target=drain, args=(conn,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    say(event="sunk", bytes=total[0], seconds=last[0] - first[0], cpu=time.process_time())


def source(args: argparse.Namespace) -> None:
    per = int(args.bytes) // args.streams
    chunk = memoryview(bytearray(1 << 20))

    def push() -> None:
        with socket.create_connection((args.host, args.port), timeout=60) as s:
            left = per
            while left > 0:
                n = min(left, len(chunk))
                s.sendall(chunk[:n])
                left -= n

    threads = [threading.Thread(target=push) for _ in range(args.streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    say(event="sent", bytes=per * args.streams, cpu=time.process_time())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    a = sub.add_parser("participant")
    a.add_argument("--url", required=True)
    a.add_argument("--token", required=True)
    a.add_argument("--name", required=True)
    a.add_argument("--params", type=float, required=True)
    a.add_argument("--tensors", type=int, default=8)
    b = sub.add_parser("sink")
    b.add_argument("--port", type=int, required=True)
    b.add_argument("--streams", type=int, default=1)
    c = sub.add_parser("source")
    c.add_argument("--host", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--streams", type=int, default=1)
    c.add_argument("--bytes", type=float, required=True)
    args = p.parse_args(argv)
    {"participant": participant, "sink": sink, "source": source}[args.what](args)


if __name__ == "__main__":
    sys.exit(main())
