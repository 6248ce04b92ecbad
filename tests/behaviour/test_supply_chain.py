"""The SBOM, the signed provenance and the commands around them, without a registry: real keys
(openssl), the real libraries (cyclonedx-python-lib, securesystemslib, in-toto-attestation), a
real inventory of this machine (its dpkg database and a Python's distributions). The registry
side runs in tests/docker/test_publish_job.py."""

from __future__ import annotations

import base64
import json
import subprocess
from pathlib import Path

import pytest

from conftest import FIXTURE_MATRIX, ROOT, run_here

GOLDEN = ROOT / "tests" / "golden" / "h20-pypi-ci" / "manifest.json"


def _keypair(d: Path, name: str, *algorithm: str) -> tuple[Path, Path]:
    key, pub = d / f"{name}.key", d / f"{name}.pub"
    subprocess.run(["openssl", "genpkey", *algorithm, "-out", str(key)], check=True, capture_output=True)
    subprocess.run(["openssl", "pkey", "-in", str(key), "-pubout", "-out", str(pub)], check=True, capture_output=True)
    return key, pub


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    return {"ed25519": _keypair(d, "a", "-algorithm", "ed25519"),
            "ecdsa": _keypair(d, "b", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256"),
            "rsa": _keypair(d, "c", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048")}


@pytest.fixture(scope="module")
def inventory():
    """This machine's real inventory: its dpkg database, its os-release and this Python's
    distributions, as an image's filesystem tar (what envbuild reads of an image: nothing runs),
    with the records of the CI golden render and the fixture lock."""
    import io
    import site
    import tarfile

    from envbuild.builds.contents import inventory as read_inventory, read_contents

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add("/var/lib/dpkg/status", "var/lib/dpkg/status")
        tar.add("/etc/os-release", "etc/os-release")  # a link to ../usr/lib/os-release, as in Debian images
        tar.add("/usr/lib/os-release", "usr/lib/os-release")
        for dist in Path(site.getsitepackages()[0]).glob("*.dist-info"):
            for name in ("METADATA", "RECORD"):
                if (dist / name).is_file():
                    tar.add(dist / name, f"opt/venv/lib/python3.11/site-packages/{dist.name}/{name}")
    inv = read_inventory(read_contents(io.BytesIO(buf.getvalue())))
    lock = (FIXTURE_MATRIX / "locks" / "torch2.11-cu130-py3.12.x86_64.txt").read_text()
    ext = [{"name": "causal-conv1d", "version": "1.5.3", "wheel": "causal_conv1d-1.5.3-cp311-linux_x86_64.whl",
            "sha256": "ab" * 32, "cache_key": "k" * 16, "arch_list": "9.0",
            "determines": {"sdist_sha256": "cd" * 32, "patches": [{"file": "setup.py", "old": "a", "new": "b",
                                                                   "source": "https://example.org/fix"}]}}]
    inv["records"] = {"manifest": GOLDEN.read_text(), "lock": lock, "extend_lock": None, "extensions": json.dumps(ext)}
    inv["python"].append({"name": "causal_conv1d", "version": "1.5.3", "location": "/opt/venv"})
    inv["image_id"], inv["platform"] = "sha256:" + "1" * 64, "linux/amd64"
    return inv


def test_the_inventory_reads_this_machines_dpkg_database_and_python(inventory):
    names = {p["package"] for p in inventory["dpkg"]}
    assert {"dpkg", "libc6", "bash"} <= names and inventory["os"]["id"] == "debian"
    assert all(p["version"] and p["architecture"] for p in inventory["dpkg"])
    assert any(d["name"].lower() == "pip" for d in inventory["python"]) or inventory["python"]


def test_the_sbom_is_valid_cyclonedx_and_lists_exactly_the_inventory(inventory):
    from envbuild.supply import sbom
    data = sbom.to_json(sbom.make_bom(inventory, "127.0.0.1:5000/envbuild:t"))  # validated against CycloneDX 1.6
    doc = json.loads(data)
    assert doc["bomFormat"] == "CycloneDX" and doc["specVersion"] == "1.6"
    assert sbom.differences(data, inventory) == []
    said = sbom.describe(data)
    assert said["image_id"] == inventory["image_id"]
    assert len(said["deb"]) == len({(p["package"], p["version"], p["architecture"]) for p in inventory["dpkg"]})
    ext = next(c for c in doc["components"] if c["name"] == "causal_conv1d")
    assert ext["hashes"] == [{"alg": "SHA-256", "content": "ab" * 32}]
    assert ext["pedigree"]["ancestors"][0]["hashes"][0]["content"] == "cd" * 32
    assert json.loads(ext["pedigree"]["patches"][0]["diff"]["text"]["content"])["source"] == "https://example.org/fix"
    image = doc["metadata"]["component"]
    assert image["type"] == "container" and {"name": "envbuild:stack", "value": "torch2.11-cu130-py3.11-pypi"} in \
        image["properties"]


def test_the_sbom_carries_the_lock_hashes_and_the_ops_built(inventory):
    from envbuild.supply import sbom
    inv = json.loads(json.dumps(inventory))
    inv["python"].append({"name": "deepspeed", "version": "0.19.8", "location": "/opt/venv"})
    doc = json.loads(sbom.to_json(sbom.make_bom(inv, "r/envbuild:t")))
    ds = next(c for c in doc["components"] if c["name"] == "deepspeed")
    props = [(p["name"], p["value"]) for p in ds["properties"]]
    assert ("envbuild:ds-op", "cpu_adam") in props and ("envbuild:lock-section", "venv") in props
    assert sum(1 for n, _ in props if n == "envbuild:lock-sha256") >= 1


def test_an_sbom_that_differs_from_the_image_is_named(inventory):
    from envbuild.supply import sbom
    data = sbom.to_json(sbom.make_bom(inventory, "r/envbuild:t"))
    inv = json.loads(json.dumps(inventory))
    inv["dpkg"] = inv["dpkg"][1:]
    inv["python"].append({"name": "evil", "version": "6.6.6", "location": "/opt/venv"})
    inv["image_id"] = "sha256:" + "2" * 64
    diff = sbom.differences(data, inv)
    assert any("describes image sha256:111111111111" in d for d in diff)
    assert any("Python packages in the image are not in it (evil 6.6.6)" in d for d in diff)
    assert any("dpkg packages it lists are not in the image" in d for d in diff)
    with pytest.raises(Exception, match="not a CycloneDX document"):
        sbom.describe(b'{"bomFormat": "CycloneDX", "specVersion": "1.6", "components": [{"type": "nope"}]}')


@pytest.mark.parametrize("kind", ["ed25519", "ecdsa", "rsa"])
def test_provenance_signed_with_a_key_verifies_with_its_public_half_only(keys, kind, tmp_path):
    from envbuild.supply import provenance as p
    from envbuild.base.errors import EnvbuildError

    doc = p.statement("127.0.0.1:5000/envbuild:t", "sha256:" + "a" * 64, {"gpu": "h20"}, GOLDEN.read_bytes(),
                      FIXTURE_MATRIX, [{"name": "sbom.cdx.json", "digest": {"sha256": "b" * 64}}], "2026-11-26T00:00:00Z",
                      {"name": "l.txt", "sha256": "c" * 64})
    envelope = p.sign(doc, p.load_signer(str(keys[kind][0])))
    assert p.open_envelope(envelope, p.load_public_key(str(keys[kind][1]))) == doc
    other = "ecdsa" if kind != "ecdsa" else "ed25519"
    with pytest.raises(EnvbuildError, match="not by the given key"):
        p.open_envelope(envelope, p.load_public_key(str(keys[other][1])))
    changed = json.loads(envelope)
    payload = json.loads(base64.b64decode(changed["payload"]))
    payload["predicate"]["runDetails"]["byproducts"][0]["digest"]["sha256"] = "e" * 64  # a swapped SBOM
    changed["payload"] = base64.b64encode(json.dumps(payload).encode()).decode()
    with pytest.raises(EnvbuildError, match="changed after it was signed"):
        p.open_envelope(json.dumps(changed).encode(), p.load_public_key(str(keys[kind][1])))
    deps = {d.get("name"): d for d in doc["predicate"]["buildDefinition"]["resolvedDependencies"]}
    assert deps["lock:l.txt"]["digest"] == {"sha256": "c" * 64} and len(deps["matrix"]["digest"]["sha256"]) == 64
    assert deps["base:runtime"]["uri"].startswith("oci://")
    assert any(d.get("digest", {}).get("gitCommit") for d in deps.values())  # this checkout's commit


def test_a_statement_of_the_wrong_shape_is_refused():
    from envbuild.supply import provenance as p
    from envbuild.base.errors import EnvbuildError

    good = {"_type": p.STATEMENT_TYPE, "subject": [{"name": "x", "digest": {"sha256": "a" * 64}}],
            "predicateType": p.SLSA_PROVENANCE,
            "predicate": {"buildDefinition": {"buildType": "urn:x", "externalParameters": {}},
                          "runDetails": {"builder": {"id": "urn:y"}}}}
    p.check_shape(good)
    for bad in ({**good, "subject": []}, {**good, "_type": "https://in-toto.io/Statement/v0.1"},
                {**good, "predicate": {**good["predicate"], "buildDefinitions": {}}}):
        with pytest.raises(EnvbuildError, match="not an in-toto Statement"):
            p.check_shape(bad)


def test_bad_keys_are_refused_with_exit_2(keys, tmp_path):
    (tmp_path / "zero").write_bytes(b"\0" * 100)
    r = run_here("verify", "127.0.0.1:5000/envbuild:t", "--key", str(keys["ed25519"][0]))
    assert r.returncode == 2 and "that is a private key" in r.stderr, r.stderr
    r = run_here("verify", "127.0.0.1:5000/envbuild:t", "--key", "/dev/zero")
    assert r.returncode == 2 and "--key /dev/zero is a character device, not a regular file" in r.stderr, r.stderr
    r = run_here("publish", "--job", "x", "--registry", "127.0.0.1:5000", "--signing-key", str(tmp_path / "zero"))
    assert r.returncode == 2 and "is not a private key envbuild can sign with" in r.stderr, r.stderr


def test_verify_and_publish_refuse_what_they_cannot_use(keys):
    r = run_here("verify", "127.0.0.1:5000/envbuild:t")
    assert r.returncode == 2 and "--key FILE" in r.stderr and "--certificate-identity-regexp" in r.stderr
    r = run_here("verify", "envbuild:t", "--key", str(keys["ed25519"][1]))
    assert r.returncode == 2 and "names no registry" in r.stderr
    r = run_here("verify", "127.0.0.1:5000/envbuild", "--key", str(keys["ed25519"][1]))
    assert r.returncode == 2 and "has no tag or digest" in r.stderr
    r = run_here("publish", "--job", "x", "--registry", "127.0.0.1:5000")
    assert r.returncode == 2 and "does not publish unsigned images" in r.stderr
    r = run_here("publish", "--job", "torch2.15-cu132-py3.11-pypi-amd65", "--registry", "127.0.0.1:5000",
                "--signing-key", str(keys["ed25519"][0]))
    assert r.returncode == 2 and "nearest: torch2.15-cu132-py3.11-pypi-amd64" in r.stderr, r.stderr
    r = run_here("publish", "--manifest", "nope", "--registry", "127.0.0.1:5000", "--signing-key",
                str(keys["ed25519"][0]))
    assert r.returncode == 2 and "no published tag of that name" in r.stderr
    r = run_here("publish", "--list")
    assert r.returncode == 0 and "job torch2.15-cu132-py3.11-pypi-amd64  " in r.stdout


def test_keyless_signing_needs_cosign(keys, tmp_path, monkeypatch):
    """Keyless signing is cosign's (CI installs it); without it, a clear refusal naming the
    alternative, before anything is built."""
    from envbuild.base.errors import EnvbuildError
    from envbuild.supply.signing import cosign

    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(EnvbuildError, match="--signing-key where there is no Sigstore"):
        cosign("sign", "--yes", "x")


def test_a_failing_variant_publishes_nothing_and_the_others_go_on(tmp_path, monkeypatch):
    """run_job with stand-in builds (no engine needed): the first variant's build fails, the
    second is still attempted; each outcome names its step, no digest is handed on for either,
    and the job's report says so. The real job of the CI stack runs in tests/docker/test_publish_job.py."""
    from envbuild.supply import release
    from envbuild.supply.signing import Signing
    from envbuild.base.errors import EnvbuildError
    from envbuild.knowledge.matrix import load_matrix

    monkeypatch.setattr(release, "audit_stack", lambda *a, **k: None)  # the lock audit: tested in test_audit.py
    monkeypatch.setattr(release, "get_engine", lambda: None)
    attempted = []

    def build(variant, build_dir):
        attempted.append(variant["variant"])
        raise EnvbuildError(f"stand-in build failure of {variant['gpu']}", exit_code=1)

    m = load_matrix()
    job = {"id": "j", "stack": "torch2.15-cu132-py3.11-pypi", "platform": "linux/amd64", "extensions": ""}
    variants = [{"variant": f"{g}:ib:", "tag": f"t-{g}", "platform": "linux/amd64", "gpu": g, "stack": job["stack"],
                 "fabric": "ib"} for g in ("h100", "h20")]
    ctx = release.JobContext(m, "127.0.0.1:9", "127.0.0.1:9/envbuild", tmp_path, Signing(), "pypi", build)
    outcomes = release.run_job(ctx, job, variants)
    assert attempted == ["h100:ib:", "h20:ib:"]
    assert [(o.ok, o.failed_step) for o in outcomes] == [(False, "build"), (False, "build")]
    assert "stand-in build failure of h20" in outcomes[1].reason
    assert not (tmp_path / "digests").exists()
    report = json.loads((tmp_path / "report.json").read_text())
    assert [o["variant"] for o in report["outcomes"]] == ["h100:ib:", "h20:ib:"]


def test_keyless_verification_asks_cosign_for_the_workflow_identity(tmp_path, monkeypatch):
    """Keyless signatures are cosign's (Fulcio, Rekor and an OIDC token are not reachable here):
    a stand-in cosign on PATH (a fake, said so) records its arguments and prints an envelope as
    `cosign verify-attestation` does; what is under test is what envbuild asks and how it reads
    the answer, and that the manifest job trusts exactly this workflow's identity."""
    from envbuild.oci.artifacts import Descriptor
    from envbuild.supply.verify import Target, signed_statement, trust_from

    digest = "sha256:" + "d" * 64
    statement = {"_type": "https://in-toto.io/Statement/v0.1", "predicateType": "https://slsa.dev/provenance/v1",
                 "subject": [{"name": "ghcr.io/acme/envbuild", "digest": {"sha256": "d" * 64}}],
                 "predicate": {"buildDefinition": {"externalParameters": {"tag": "t"}}}}
    envelope = json.dumps({"payloadType": "application/vnd.in-toto+json",
                           "payload": base64.b64encode(json.dumps(statement).encode()).decode(), "signatures": []})
    log = tmp_path / "argv"
    cosign = tmp_path / "cosign"
    cosign.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\necho '{envelope}'\n")
    cosign.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setenv("GITHUB_SERVER_URL", "https://github.com")
    monkeypatch.setenv("GITHUB_WORKFLOW_REF", "acme/envbuild/.github/workflows/publish.yml@refs/heads/main")
    trust = trust_from(None, None, None, keyless=True)
    assert trust.identity == r"^https://github\.com/acme/envbuild/\.github/workflows/publish\.yml@refs/heads/main$"
    target = Target("ghcr.io", "acme/envbuild", "t", "linux/amd64", Descriptor("m", digest, 1), "sha256:" + "c" * 64)
    doc, why = signed_statement(None, target, trust)
    assert doc == statement and "(cosign)" in why
    argv = log.read_text().split()
    assert argv[:3] == ["verify-attestation", "--type", "slsaprovenance1"]
    assert argv[argv.index("--certificate-identity-regexp") + 1] == trust.identity
    assert argv[argv.index("--certificate-oidc-issuer") + 1] == "https://token.actions.githubusercontent.com"
    assert argv[-1] == f"ghcr.io/acme/envbuild@{digest}"
    other = Target("ghcr.io", "acme/envbuild", "t", "linux/amd64", Descriptor("m", "sha256:" + "e" * 64, 1), "")
    assert signed_statement(None, other, trust) == (None, "no provenance for this digest")
