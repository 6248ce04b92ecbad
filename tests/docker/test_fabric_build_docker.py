"""The test fabric of tests/fixtures/fabric-build, a data entry only (added to a copy of the
fixture matrix), built for real by the step script its render carries: in a small builder
(the base image with build-essential and curl, not a torch image) fabric.sh downloads both
sources from 127.0.0.1, checks their pins, builds one by make and one by configure in order,
drops, links, checks; then a bare container of the base takes the prefixes as the runtime
stage copies them and fabric-install.sh registers them: the tool runs from PATH with no
LD_LIBRARY_PATH. About 2 minutes (apt installs the compilers each run)."""

from __future__ import annotations

import functools
import http.server
import shlex
import threading

import pytest

from conftest import BASE_IMAGE, docker, unique
from test_fabric_build import fabric_steps, matrix_with_test_fabric, write_sources

BUILDER_PACKAGES = "build-essential curl ca-certificates"
NO_ARCHIVE = 97  # the builder's exit status when apt cannot install them (not the fabric's failure)


@pytest.fixture
def served(tmp_path):
    """The fixture sources as .tar.gz on 127.0.0.1 (a container on the host's network reaches it)."""
    root = tmp_path / "sources"
    write_sources(root)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _run(tmp_path, steps, script: str, name: str):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return docker("run", "--rm", "--name", unique(name), "--network", "host",
                  "-v", f"{steps}:/opt/envbuild-setup:ro", "-v", f"{out}:/out", BASE_IMAGE, "bash", "-c", script,
                  check=False, timeout=900)


def test_a_fabric_declared_only_as_data_builds_installs_and_runs_from_its_render(tmp_path, served, cli):
    matrix_dir = matrix_with_test_fabric(tmp_path / "m", port=served)
    r = cli("render", "--gpu", "h20", "--fabric", "greet", "--matrix-dir", str(matrix_dir), "-o", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    _, build, install = fabric_steps(matrix_dir)
    steps = tmp_path / "o" / "envbuild" / "steps"  # the rendered build directory's scripts
    built = _run(tmp_path, steps, f"""set -e
        apt-get update -qq > /dev/null && apt-get install -y -qq --no-install-recommends {BUILDER_PACKAGES} > /dev/null \
            || exit {NO_ARCHIVE}
        bash /opt/envbuild-setup/fabric.sh {shlex.join(build.args)}
        tar -cf /out/prefixes.tar /opt/greet /opt/greet-tool""", "fabric-builder")
    if built.returncode == NO_ARCHIVE:
        pytest.skip(f"the container reaches no Debian archive to install {BUILDER_PACKAGES} from: {built.stderr[-300:]}")
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-4000:]
    log = built.stderr
    assert "greet-tool HAVE_LIBGREET 1" in log and "greet: hello fabric from libgreet 1.0, tool 1.0" in log, log
    assert "/opt/greet/lib/alias/libgreet-alias.so -> /opt/greet/lib/libgreet.so.1" in log, log
    ran = _run(tmp_path, steps, f"""set -e
        tar -xf /out/prefixes.tar -C /
        bash /opt/envbuild-setup/fabric-install.sh {shlex.join(install.args)}
        env -u LD_LIBRARY_PATH greet runtime
        cat {install.args[0]}
        test ! -e /opt/greet/include && readlink /opt/greet/lib/alias/libgreet-alias.so""", "fabric-runtime")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.split("\n")[:3] == ["hello runtime from libgreet 1.0, tool 1.0", "/opt/greet/lib",
                                          "/opt/greet/lib/libgreet.so.1"], ran.stdout
