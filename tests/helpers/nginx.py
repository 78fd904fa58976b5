"""A real nginx in front of a coordinator, for the deployment tests: the site config is the
shipped one (`deploy/nginx/fedtrain.conf`, the file docs/deploy.md quotes) with its @NAME@
placeholders filled in, inside a main config of the test's own, run as a subprocess on a free
127.0.0.1 port with its prefix, logs, pid file and temp dirs under the test's directory. No
system config is read or written (`-c`, `-p` and `-e` point into that directory).

    with Nginx(tmp_path / "nginx", upstream=c.url, cert=cert, key=key, max_body="8m") as proxy:
        httpx.get(proxy.url + "/v1/healthz", verify=str(ca))
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from tests.helpers.processes import free_port, kill_tree, track

ROOT = Path(__file__).resolve().parents[2]
SITE_TEMPLATE = ROOT / "deploy" / "nginx" / "fedtrain.conf"
PLACEHOLDER = re.compile(r"@([A-Z_]+)@")
START_TIMEOUT_S = 20.0


def nginx_binary() -> str | None:
    """Debian's nginx (`apt-get install -y nginx`), or whichever is on PATH; None without one."""
    found = shutil.which("nginx")
    if found:
        return found
    return "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None


def render(template: str, **values: str) -> str:
    """`template` with every @NAME@ replaced by values[NAME]; a placeholder left without a value,
    or a value that names no placeholder, is an error (the template and its users stay in step)."""
    names = set(PLACEHOLDER.findall(template))
    if names != set(values):
        raise ValueError(f"placeholders {sorted(names)}, values given for {sorted(values)}")
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def site_config(*, upstream: str, listen: str, server_name: str, cert: Path, key: Path, max_body: str,
                access_log: Path) -> str:
    """The shipped site config, filled in."""
    return render(SITE_TEMPLATE.read_text(), UPSTREAM=upstream, LISTEN=listen, SERVER_NAME=server_name,
                  TLS_CERT=str(cert), TLS_KEY=str(key), MAX_BODY=max_body, ACCESS_LOG=str(access_log))


def main_config(prefix: Path, site: Path) -> str:
    """nginx.conf around the site: in the foreground, everything it writes under `prefix`.

    Started as root, nginx runs its workers as `nobody`, which cannot enter pytest's
    temp dirs (mode 700): the workers then run as the user that started it."""
    user = f"user {pwd.getpwuid(os.geteuid()).pw_name};\n" if os.geteuid() == 0 else ""
    return f"""{user}daemon off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log off;  # the site config names its own log
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    include {site};
}}
"""


class Nginx:
    """nginx serving the shipped site config over TLS on a free 127.0.0.1 port, proxying to
    `upstream` (a coordinator's http:// URL); `url` is its https:// address, `access_log` its
    log. A context manager: it starts nginx, waits (bounded) until it accepts connections, and
    stops it on exit. `edit` changes the filled-in site config (to see what a setting does)."""

    def __init__(self, prefix: Path, *, upstream: str, cert: Path, key: Path, max_body: str,
                 edit: Callable[[str], str] = lambda text: text) -> None:
        binary = nginx_binary()
        if binary is None:
            raise FileNotFoundError("nginx is not installed (apt-get install -y nginx)")
        self.binary, self.prefix = binary, prefix
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.access_log = prefix / "access.log"
        host = upstream.split("://", 1)[-1].rstrip("/")
        self.site_text = edit(site_config(upstream=host, listen=f"127.0.0.1:{self.port}", server_name="localhost",
                                          cert=cert, key=key, max_body=max_body, access_log=self.access_log))
        self.proc: subprocess.Popen | None = None

    def config_path(self) -> Path:
        """Writes the site and main configs under the prefix; returns the main one."""
        self.prefix.mkdir(parents=True, exist_ok=True)
        site = self.prefix / "fedtrain.conf"
        site.write_text(self.site_text)
        conf = self.prefix / "nginx.conf"
        conf.write_text(main_config(self.prefix, site))
        return conf

    def check(self) -> subprocess.CompletedProcess:
        """`nginx -t` on the config: is it one nginx accepts?"""
        conf = self.config_path()
        return subprocess.run([self.binary, "-t", "-p", str(self.prefix), "-e", str(self.prefix / "error.log"),
                               "-c", str(conf)], capture_output=True, text=True, timeout=30)

    def log(self) -> str:
        path = self.prefix / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def __enter__(self) -> Nginx:
        conf = self.config_path()
        out = open(self.prefix / "stdout.log", "wb")
        with out:
            self.proc = track(subprocess.Popen(
                [self.binary, "-p", str(self.prefix), "-e", str(self.prefix / "error.log"), "-c", str(conf)],
                stdout=out, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.proc.returncode}:\n{self.log()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise RuntimeError(f"nginx did not listen within {START_TIMEOUT_S:g} s:\n{self.log()}") from None
                time.sleep(0.05)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.proc is None:
            return
        self.proc.terminate()  # SIGTERM: nginx's fast shutdown (the master stops its workers)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
