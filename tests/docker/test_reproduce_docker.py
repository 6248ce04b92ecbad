"""`envbuild rebuild` with a real engine up: a hostile record is refused before the engine does
anything (no build directory, no new image). The rest of `diff` and `rebuild`, without an
engine, is tests/behaviour/test_reproduce.py; the real images are in tests/docker/test_oslock_docker.py."""

from __future__ import annotations

import json

from conftest import FIXTURE_MATRIX
from test_reproduce import with_field


def test_docker_rebuild_of_a_record_with_an_injected_base_builds_nothing(tmp_path):
    """With a real engine up: a manifest.json (the one `render` writes for the fixture's CI
    stack) whose base carries a newline and a RUN, with the render digest an attacker computes
    for it, is exit 2 naming the field; no build directory, no new image, no build log."""
    from conftest import docker, run_cli

    doc = json.loads(with_field("base_images.builder", "local/debian:bookworm\nRUN touch /PWNED"))
    assert "RUN touch /PWNED" in doc["base_images"]["builder"]  # the case the issue reproduced
    (tmp_path / "manifest.json").write_text(json.dumps(doc))
    before = docker("images", "-qa", "--no-trunc").stdout.split()
    r = run_cli("rebuild", str(tmp_path / "manifest.json"), "--matrix-dir", str(FIXTURE_MATRIX),
                "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert r.returncode == 2 and "base_images.builder" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
    assert sorted(docker("images", "-qa", "--no-trunc").stdout.split()) == sorted(before)
