"""An OSV query endpoint on 127.0.0.1 serving real advisory records (tests/fixtures/advisories,
copied from the PyPA advisory database), for pip-audit's `--osv-url`.

Why a local one: pip-audit's default source, PyPI's per-release JSON
(https://pypi.org/pypi/NAME/VERSION/json), answers 404 from this machine's network and
api.osv.dev is not reachable; on a runner that reaches them, pip-audit asks them directly. What
this serves is the part of OSV's API pip-audit uses (https://google.github.io/osv.dev/post-v1-query/):
POST {"package": {"name", "ecosystem"}, "version"} -> {"vulns": [records whose `affected`
entry names the package and lists the version]}, or {} for none. The matching is OSV's for
enumerated versions; the records are not edited.

    with OsvServer() as osv:
        ... envbuild audit --vulnerability-service {osv.url} ...
    python tests/tools/osv_server.py 8799   # serve until killed (bench, by hand)
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "advisories"


def load_records(directory: Path = FIXTURES) -> list[dict]:
    return [yaml.safe_load(p.read_text()) for p in sorted(directory.glob("*.yaml"))]


def matches(record: dict, name: str, version: str) -> bool:
    norm = name.lower().replace("_", "-").replace(".", "-")
    return any(a["package"]["ecosystem"] == "PyPI" and a["package"]["name"].lower().replace("_", "-") == norm
               and version in [str(v) for v in a.get("versions", [])] for a in record.get("affected", []))


class OsvServer:
    def __init__(self, port: int = 0, records: list[dict] | None = None):
        records = load_records() if records is None else records
        self.queries: list[dict] = []
        served = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                try:
                    body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                    query = json.loads(body)
                    served.queries.append(query)
                    vulns = [r for r in records if matches(r, query["package"]["name"], query["version"])]
                    data, status = json.dumps({"vulns": vulns} if vulns else {}, default=str).encode(), 200
                except Exception as error:  # noqa: BLE001 - said to the client, not a dropped connection
                    data, status = f"osv_server: {type(error).__name__}: {error}".encode(), 500
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            request_queue_size = 128  # a burst of connections waits instead of being refused

        self.server = Server(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/query"

    def __enter__(self) -> "OsvServer":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":
    with OsvServer(int(sys.argv[1]) if len(sys.argv) > 1 else 0) as osv:
        print(osv.url, flush=True)
        threading.Event().wait()
