"""`verify` and `stage` against the local registry (127.0.0.1:5000, scripts/host-setup.sh): what
tests/behaviour/test_verify_trust.py shows on its in-memory registry, once against the real one."""

from __future__ import annotations

import hashlib

from conftest import run_here
from envbuild.oci.registry import OCI_MANIFEST
from test_supply_chain import inventory, keys  # noqa: F401  (the module's real keys and inventory)
from test_verify_trust import REPO, attach_unsigned_sqsh_first, push_signed


def test_the_local_registry_refuses_an_extra_unsigned_sqsh_and_a_sibling_tag(keys, inventory, tmp_path):  # noqa: F811
    """Against the local registry (127.0.0.1:5000, Docker's registry:2): a signed tag as `publish`
    leaves it verifies and stages; then (a) an unsigned .sqsh attached ahead of the signed one:
    verify fails naming both, stage refuses and stages nothing; (b) the signed image pushed under
    the sibling tag TAG-efa: verify refuses."""
    from envbuild.oci.artifacts import Registry

    client = Registry("127.0.0.1:5000")
    tag = f"trust-{hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12]}"  # a tag of this run only
    pushed = push_signed(client, tag, keys["ed25519"][0], inventory, sqsh=f"hsqs signed {tag}".encode())
    ref, pub = f"127.0.0.1:5000/{REPO}:{tag}", str(keys["ed25519"][1])
    r = run_here("verify", ref, "--key", pub, "--no-pull")
    assert r.returncode == 0 and "VERIFIED" in r.stdout, r.stdout + r.stderr
    staged = tmp_path / "shared"
    staged.mkdir()
    r = run_here("stage", ref, "--to", str(staged), "--key", pub)
    assert r.returncode == 0 and "fetching the signed .sqsh" in r.stderr, r.stdout + r.stderr
    (file,) = staged.glob("*.sqsh")
    assert file.read_bytes() == pushed["sqsh"]
    for p in staged.iterdir():
        p.unlink()

    client.put_manifest(REPO, f"{tag}-efa", pushed["body"], OCI_MANIFEST)  # (b)
    r = run_here("verify", f"127.0.0.1:5000/{REPO}:{tag}-efa", "--key", pub, "--no-pull")
    assert r.returncode == 1 and f"not {tag}-efa" in r.stdout and "NOT VERIFIED" in r.stdout, r.stdout
    r = run_here("stage", f"127.0.0.1:5000/{REPO}:{tag}-efa", "--to", str(staged), "--key", pub)
    assert r.returncode == 1 and f"not {tag}-efa" in r.stderr and not list(staged.iterdir()), r.stderr

    unsigned = attach_unsigned_sqsh_first(client, pushed["subject"])  # (a)
    signed_digest = "sha256:" + hashlib.sha256(pushed["sqsh"]).hexdigest()
    r = run_here("verify", ref, "--key", pub, "--no-pull")
    line = next(x for x in r.stdout.splitlines() if " sqsh " in f" {x} ")
    assert r.returncode == 1 and line.startswith("FAIL") and unsigned in line and signed_digest in line, r.stdout
    r = run_here("stage", ref, "--to", str(staged), "--key", pub)
    assert r.returncode == 1 and unsigned in r.stderr and not list(staged.iterdir()), r.stderr
