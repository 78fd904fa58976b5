"""A rank of a torchrun group, forked by `tests.helpers.zygote`'s template: torchrun runs this
script (`--no-python`) in the rank's place; it asks the template (its socket in
`FEDTRAIN_TEST_ZYGOTE_SOCKET`) to fork `python ARGS` with this process's environment, directory
and standard streams, passes on every signal torchrun sends, and ends as the rank ended: with
its status, or killed by the same signal. If it is killed, the template kills the rank (it
sees the request's connection close). Only the standard library: it starts in ~20 ms. A rank
whose environment asks for an interpreter started differently (PYTHONVERBOSE, ...) runs as
`python ARGS` in this process instead."""

import contextlib
import json
import os
import signal
import socket
import sys

SOCKET_ENV = "FEDTRAIN_TEST_ZYGOTE_SOCKET"
STARTUP_ENV = "FEDTRAIN_TEST_ZYGOTE_STARTUP"


def main() -> None:
    args = sys.argv[1:]
    emulated = ("PYTHONPATH", "PYTHONUNBUFFERED")  # as tests.helpers.zygote.EMULATED
    started = {k: v for k, v in os.environ.items() if k.startswith("PYTHON") and k not in emulated}
    if started != json.loads(os.environ.get(STARTUP_ENV, "{}")):  # an interpreter started differently
        os.execv(sys.executable, [sys.executable, *args])
    unbuffered = args[:1] == ["-u"]
    args = args[1:] if unbuffered else args
    if args[:1] == ["-m"]:
        request = {"module": True, "target": args[1], "args": args[2:]}
    else:
        request = {"module": False, "target": args[0], "args": args[1:]}
    request.update(unbuffered=unbuffered, env=dict(os.environ), cwd=os.getcwd())
    child: list[int] = []  # the rank's pid, once the template answered
    pending: list[int] = []  # signals that came before it

    def forward(sig: int, _frame: object) -> None:
        if not child:
            pending.append(sig)
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(child[0], sig)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
        signal.signal(sig, forward)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(os.environ[SOCKET_ENV])
    socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
    child.append(json.loads(sock.recv(4096))["pid"])
    for sig in pending:
        forward(sig, None)
    message = sock.recv(4096)  # the rank's end (retried across the signals we pass on)
    code = json.loads(message)["returncode"] if message else -signal.SIGKILL
    if code < 0:  # killed by a signal: end the same way, for torchrun to see
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
