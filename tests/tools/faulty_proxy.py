"""A TCP proxy on 127.0.0.1 in front of a real registry that fails chosen requests: it answers
500, or drops the connection, for requests whose first line matches, a given number of times
(or always). What a flaky registry, a load balancer resetting connections, or a registry that
runs out of disk does to a push, reproducibly, without touching the registry itself.

    with FaultyProxy(("127.0.0.1", 5000), r"^PUT /v2/.*/manifests/", "500", times=None) as proxy:
        ... push to f"127.0.0.1:{proxy.port}" ...

The request is recognised by its first line, at the start of what the client sends after the
previous response (Docker's registry client sends one request at a time per connection).
"""

from __future__ import annotations

import functools
import re
import socket
import threading
from typing import Optional


def pump(src: socket.socket, dst: socket.socket, before_send=None) -> None:
    """Copy one direction until either side closes, then shut both down; `before_send(chunk)`, if
    given, sees each chunk first (and may hold it)."""
    try:
        while chunk := src.recv(65536):
            if before_send:
                before_send(chunk)
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class FaultyProxy:
    def __init__(self, upstream: tuple[str, int], pattern: str, fault: str, times: Optional[int] = None):
        assert fault in ("500", "drop")
        self.upstream, self.pattern, self.fault = upstream, re.compile(pattern.encode()), fault
        self.left = times  # None: always
        self.failed: list[str] = []  # the request lines it failed
        self.seen: list[str] = []
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._stop = False

    def __enter__(self):
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._stop = True
        self._server.close()

    def _accept(self):
        while not self._stop:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _should_fail(self, first_line: bytes) -> bool:
        with self._lock:
            self.seen.append(first_line.decode(errors="replace"))
            if not self.pattern.search(first_line) or self.left == 0:
                return False
            if self.left is not None:
                self.left -= 1
            self.failed.append(first_line.decode(errors="replace"))
            return True

    def _serve(self, client: socket.socket):
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        threading.Thread(target=pump, args=(upstream, client), daemon=True).start()
        try:
            while chunk := client.recv(65536):
                first = chunk.split(b"\r\n", 1)[0]
                if re.match(rb"^[A-Z]+ /v2/", first) and self._should_fail(first):
                    if self.fault == "500":
                        body = b'{"errors":[{"code":"UNKNOWN","message":"injected by the test"}]}'
                        client.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                                       b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
                    break  # "drop": close both sides, mid-request
                upstream.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                try:
                    s.close()
                except OSError:
                    pass


class SocketCutter:
    """A unix-socket proxy in front of the Docker engine's socket whose `cut()` closes every
    connection at once: to the client, the engine went away mid-operation (a daemon restart, a
    node reboot), without stopping the real daemon that other tests use.

        with SocketCutter("/var/run/docker.sock", tmp / "d.sock", at_build=True) as cutter:
            env DOCKER_HOST=unix://<tmp>/d.sock ...; cutter.wait_cut(600)

    `at_build`: cut while the engine is building, whatever the build's speed. A BuildKit build
    reads its Dockerfile and context from the client through the client's /session connection,
    and only after the engine has the /build request. So when a /build request goes by, the
    proxy first stops passing session traffic, then lets the request through and cuts a moment
    later: the engine has the build and cannot finish it (a fully cached build otherwise ends
    in well under a second on a fast machine, before any timed cut).
    """

    SESSION = re.compile(rb"^POST /(v[0-9.]+/)?session[ ?]")
    BUILD = re.compile(rb"^POST /(v[0-9.]+/)?build[ ?]")

    def __init__(self, upstream: str, path, at_build: bool = False):
        self.upstream, self.path, self.at_build = upstream, str(path), at_build
        self._server = socket.socket(socket.AF_UNIX)
        self._server.bind(self.path)
        self._server.listen(64)
        self._live: list[socket.socket] = []
        self._lock = threading.Lock()
        self.closed = False
        self.build_requests: list[str] = []  # the /build request lines that went by
        self._sessions_held = threading.Event()
        self._cut = threading.Event()

    def __enter__(self):
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.cut()
        self._server.close()

    def cut(self):
        self.closed = True
        self._cut.set()
        with self._lock:
            for s in self._live:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                    s.close()
                except OSError:
                    pass
            self._live.clear()

    def wait_cut(self, timeout: float) -> bool:
        return self._cut.wait(timeout)

    def _accept(self):
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if self.closed:
                client.close()
                continue
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(self.upstream)
            with self._lock:
                self._live += [client, upstream]
            conn = {"session": False}  # each connection's own: bound into its hooks below
            requests, replies = ((functools.partial(self._request, conn=conn), lambda _, conn=conn: self._hold(conn))
                                 if self.at_build else (None, None))
            threading.Thread(target=pump, args=(client, upstream, requests), daemon=True).start()
            threading.Thread(target=pump, args=(upstream, client, replies), daemon=True).start()

    def _hold(self, conn) -> None:
        """A session connection passes nothing once a build has gone by, until the cut."""
        if conn["session"] and self._sessions_held.is_set():
            self._cut.wait()

    def _request(self, chunk: bytes, conn) -> None:
        """Marks the session connection; a /build request goes through, the sessions are held from
        then on, and the cut follows."""
        first = chunk.split(b"\r\n", 1)[0]
        if self.SESSION.match(first):
            conn["session"] = True
        if self.BUILD.match(first):
            self.build_requests.append(first.decode(errors="replace"))
            self._sessions_held.set()
            threading.Timer(2.0, self.cut).start()  # the engine holds the build by then
            return
        self._hold(conn)
