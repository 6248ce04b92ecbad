"""The publish job of the CI stack run for real, as the workflow runs it (`envbuild publish
--job`, then `envbuild publish --manifest`), against a registry of its own with TLS (a
throw-away CA) and htpasswd authentication (`docker login` into a private DOCKER_CONFIG), then
`envbuild verify` and `envbuild stage` of what it published, and each way verification must fail.

The registry is Debian's docker-registry 2.8: it has no OCI referrers API, so everything attached
goes through the referrers tag schema's fallback (an index under the tag sha256-<digest>).
Vulnerability data: the local OSV endpoint of tests/tools/osv_server.py (real PyPA advisories;
PyPI's per-release JSON, pip-audit's default source, answers 404 from here). The publish.yaml is
the CI stack's job with one GPU variant (h20), to keep the run short; every step of the job runs.

Build arguments (base image, CA bundle) as tests/docker/test_docker_e2e.py passes them.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import conftest
from conftest import DOCKER, ROOT, ci_stack_id, run_cli

sys.path.insert(0, str(ROOT / "tests" / "tools"))
from osv_server import OsvServer  # noqa: E402

BASE = "local/debian:bookworm"
STACK = ci_stack_id()
JOB = f"{STACK}-amd64"
docker = conftest.docker


# What every image-building test passes, from the one place (conftest): this machine's base,
# its CA bundle for pip behind the TLS proxy, its index URLs.
BUILD_ARGS = tuple(conftest.machine_build_args())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("publish")


@pytest.fixture(scope="module")
def registry(work):
    """docker-registry with TLS (a CA made here) and htpasswd, logged in with `docker login`."""
    d = work / "registry"
    d.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=envbuild-publish-test-ca",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"))
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", str(d / "tls.key"),
             "-out", str(d / "tls.csr"))
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", str(d / "tls.csr"), "-CA", str(d / "ca.crt"), "-CAkey", str(d / "ca.key"),
             "-CAcreateserial", "-days", "2", "-extfile", str(d / "san.cnf"), "-out", str(d / "tls.crt"))
    password = hashlib.sha256(os.urandom(16)).hexdigest()[:20]
    subprocess.run(["htpasswd", "-Bbc", str(d / "htpasswd"), "publisher", password], check=True, capture_output=True)
    port = _free_port()
    (d / "config.yml").write_text(
        f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {d / 'store'}\n"
        f"  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n  tls:\n    certificate: {d / 'tls.crt'}\n"
        f"    key: {d / 'tls.key'}\nauth:\n  htpasswd:\n    realm: envbuild-test\n    path: {d / 'htpasswd'}\n")
    proc = subprocess.Popen(["docker-registry", "serve", str(d / "config.yml")], stdout=subprocess.DEVNULL,
                            stderr=open(d / "registry.log", "w"))
    bundle = d / "bundle.pem"
    bundle.write_bytes(Path(conftest.CA_BUNDLE).read_bytes() + (d / "ca.crt").read_bytes())
    try:
        for _ in range(100):
            r = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--cacert", str(d / "ca.crt"),
                                f"https://127.0.0.1:{port}/v2/"], capture_output=True, text=True)
            if r.stdout == "401":
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the TLS registry did not answer: {(d / 'registry.log').read_text()[-1000:]}")
        config = d / "docker-config"
        config.mkdir()
        login = subprocess.run([DOCKER, "--config", str(config), "login", f"127.0.0.1:{port}", "-u", "publisher",
                                "--password-stdin"], input=password, capture_output=True, text=True)
        assert login.returncode == 0, login.stderr
        yield {"host": f"127.0.0.1:{port}", "dir": d, "env": {
            "DOCKER_CONFIG": str(config), "REQUESTS_CA_BUNDLE": str(bundle), "SSL_CERT_FILE": str(bundle)}}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(d / "store", ignore_errors=True)
        for repo in ("envbuild", "envbuild-plain"):  # what the job built and pushed, what a test pushed
            conftest.remove_images(repo, registry=f"127.0.0.1:{port}")


@pytest.fixture(scope="module")
def osv():
    with OsvServer() as server:
        yield server


@pytest.fixture(scope="module")
def keys(work):
    out = {}
    for name in ("ours", "theirs"):
        key, pub = work / f"{name}.key", work / f"{name}.pub"
        _openssl("genpkey", "-algorithm", "ed25519", "-out", str(key))
        _openssl("pkey", "-in", str(key), "-pubout", "-out", str(pub))
        out[name] = (key, pub)
    return out


@pytest.fixture(scope="module")
def env(work, registry, osv):
    state = work / "state"
    state.mkdir(exist_ok=True)
    return {**registry["env"], "ENVBUILD_STATE_DIR": str(state), "ENVBUILD_VULNERABILITY_SERVICE": osv.url}


def _matrix(work: Path, host: str, name: str = "matrices") -> Path:
    """The production matrix, publishing the CI stack's h20 variant to `host`. Its default op
    preset is the two ops tests/docker/test_docker_e2e.py builds, so the job's ops layer comes from that
    build's cache instead of compiling seven ops again (what is under test is the job, not the ops)."""
    d = work / name
    shutil.copytree(conftest.ROOT / "matrices", d)
    (d / "publish.yaml").write_text(f'registry: "{host}"\nimage_repo: envbuild\ngpus: [h20]\n')
    ds = d / "deepspeed.yaml"
    text = ds.read_text()
    preset = "  training: [cpu_adam, cpu_adagrad, cpu_lion, utils, fused_adam, fused_lamb, fused_lion]\n"
    assert preset in text, "the training preset changed: update this test's copy"
    ds.write_text(text.replace(preset, "  training: [cpu_adam, fused_adam]\n"))
    return d


@pytest.fixture(scope="module")
def published(work, registry, env, keys):
    """The CI stack's job, then its manifest job, exactly as the workflow runs them."""
    matrix = _matrix(work, registry["host"])
    out = work / "out"
    job = run_cli("publish", "--job", JOB, "--registry", registry["host"], "--signing-key", str(keys["ours"][0]),
                  "--matrix-dir", str(matrix), "--out", str(out), *BUILD_ARGS, env=env, timeout=5400)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-5000:]
    handed_on = sorted(p.name for p in (out / "digests").iterdir())
    assert len(handed_on) == 1 and handed_on[0].endswith("-amd64"), handed_on
    tag = handed_on[0].removesuffix("-amd64")  # the h20 variant's readable tag
    manifest = run_cli("publish", "--manifest", tag, "--registry", registry["host"], "--digests",
                       str(out / "digests"), "--key", str(keys["ours"][1]), "--signing-key", str(keys["ours"][0]),
                       "--matrix-dir", str(matrix), env=env, timeout=600)
    assert manifest.returncode == 0, manifest.stdout + manifest.stderr
    digest = (out / "digests" / f"{tag}-amd64").read_text().strip()
    return {"job": job, "manifest": manifest, "tag": tag, "digest": digest, "out": out, "matrix": matrix,
            "ref": f"{registry['host']}/envbuild:{tag}"}


@pytest.fixture(scope="module")
def client(registry):
    """The artifacts client as envbuild makes it, in this process: the test's own view of the
    registry (its credentials and CA only while this module runs)."""
    from envbuild.oci.artifacts import Registry

    saved = {k: os.environ.get(k) for k in registry["env"]}
    os.environ.update(registry["env"])
    try:
        yield Registry(registry["host"])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _verify(published, env, key, *extra):
    return run_cli("verify", published["ref"], "--key", str(key), *extra, env=env, timeout=900)


def _push_base(registry, ref: str) -> None:
    """Push the debootstrap base under `ref` with `docker push` (an image envbuild did not publish)."""
    docker("tag", BASE, ref)
    try:
        push = subprocess.run([DOCKER, "--config", registry["env"]["DOCKER_CONFIG"], "push", ref], capture_output=True,
                              text=True)
        assert push.returncode == 0, push.stderr
    finally:
        docker("rmi", ref, check=False)


# ---------------------------------------------------------------- the job


def test_the_job_publishes_the_image_with_its_sbom_smoke_record_sqsh_and_signed_provenance(published, registry, client):
    job = published["job"]
    assert f"published h20:ib:  {registry['host']}/envbuild@{published['digest']}  linux/amd64" in job.stdout
    report = json.loads((published["out"] / "report.json").read_text())
    outcome = report["outcomes"][0]
    assert report["job"] == JOB and outcome["ok"] and outcome["digest"] == published["digest"]
    assert set(outcome["seconds"]) >= {"build", "smoke", "sbom", "audit", "sqsh", "push", "attach", "attach:sqsh",
                                       "provenance", "sign"}
    assert outcome["bytes"]["sqsh"] > 1 << 30 and outcome["bytes"]["sbom"] > 10_000
    assert client.referrers_api("envbuild", published["digest"]) is None  # docker-registry 2.8: no referrers API
    kinds = sorted(d.artifact_type for d in client.referrers("envbuild", published["digest"]))
    assert kinds == ["application/vnd.cyclonedx+json", "application/vnd.dsse.envelope.v1+json",
                     "application/vnd.envbuild.enroot.sqsh.v1", "application/vnd.envbuild.smoke-record.v1+json"]
    assert client.exists("envbuild", "sha256-" + published["digest"].split(":")[1])  # the fallback index
    statement = json.loads((published["out"] / "attestations" / "h20-ib" / "provenance.json").read_text())
    assert statement["predicate"]["buildDefinition"]["externalParameters"]["tag"] == published["tag"]
    assert f"linux/amd64 {published['digest']}" in published["manifest"].stdout


def test_verify_passes_on_the_freshly_published_tag(published, env, keys):
    r = _verify(published, env, keys["ours"][1])
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    for check in ("signature", "provenance", "sbom", "smoke", "sqsh"):
        assert any(line.startswith("ok") and f" {check} " in f" {line} " for line in lines), (check, r.stdout)
    assert "manifest.json matches" in r.stdout and "matches the image:" in r.stdout
    assert lines[-1].startswith(f"VERIFIED: {published['ref']}")
    data = json.loads(_verify(published, env, keys["ours"][1], "--json").stdout)
    assert data["ok"] is True and {c["check"] for c in data["checks"]} == {"signature", "provenance", "sbom", "smoke",
                                                                          "sqsh"}


def test_a_republish_of_the_unchanged_job_builds_nothing_and_hands_on_the_same_digest(published, registry, env, keys,
                                                                                        work):
    """The scheduled run of an unchanged job: the registry serves the variant's image from the same
    rendered files with provenance this key signed, so the job audits its SBOM's pins again and
    hands the same digest on, without building, smoke-testing, exporting or pushing anything."""
    out = work / "republish-out"
    plan = run_cli("publish", "--job", JOB, "--registry", registry["host"], "--matrix-dir", str(published["matrix"]),
                   "--plan", "--out", str(out), env=env, timeout=300)
    assert plan.returncode == 0 and "published      yes: handed on as it is" in plan.stdout, plan.stdout + plan.stderr
    r = run_cli("publish", "--job", JOB, "--registry", registry["host"], "--signing-key", str(keys["ours"][0]),
                "--matrix-dir", str(published["matrix"]), "--out", str(out), *BUILD_ARGS, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    said = " ".join(r.stdout.split())
    assert f"unchanged h20:ib: {registry['host']}/envbuild@{published['digest']} linux/amd64" in said, r.stdout
    assert "was published from the same rendered files" in " ".join(r.stderr.split()), r.stderr[-2000:]
    assert f"publish --manifest {published['tag']}" in said  # the next command, as after a build
    assert (out / "digests" / f"{published['tag']}-amd64").read_text().strip() == published["digest"]
    (outcome,) = json.loads((out / "report.json").read_text())["outcomes"]
    assert outcome["ok"] and outcome["published_before"] and not outcome["compiles"]
    assert set(outcome["seconds"]) == {"published before", "audit"}  # no build, smoke, sqsh, push or sign
    assert not (out / "attestations").exists() and not (out / "build" / "h20-ib" / "build.log").exists()


def test_verify_fails_with_another_key(published, env, keys):
    r = _verify(published, env, keys["theirs"][1])
    assert r.returncode == 1
    assert "FAIL signature" in r.stdout and "not by the given key" in r.stdout, r.stdout
    assert "not checked: no verified provenance" in r.stdout and r.stdout.splitlines()[-1].startswith("NOT VERIFIED")


def _index(client, digest):
    tag = "sha256-" + digest.split(":")[1]
    return tag, client.manifest("envbuild", tag)[1]


def _drop_from_index(client, digest, dropped: set) -> None:
    """What someone replacing an attachment does: the referrers index no longer lists it (the
    artifact itself stays in the registry, so the saved index can be put back)."""
    from envbuild.oci.registry import OCI_INDEX

    tag, body = _index(client, digest)
    index = json.loads(body)
    index["manifests"] = [m for m in index["manifests"] if m["digest"] not in dropped]
    client.put_manifest("envbuild", tag, json.dumps(index).encode(), OCI_INDEX)


def test_verify_fails_on_a_tampered_sbom(published, env, keys, registry, client):
    """Someone replaces the SBOM attached to the image by one that hides a package."""
    from envbuild.oci.artifacts import Blob
    from envbuild.oci.registry import OCI_INDEX

    tag, saved = _index(client, published["digest"])
    sbom = json.loads((published["out"] / "attestations" / "h20-ib" / "sbom.cdx.json").read_text())
    sbom["components"] = [c for c in sbom["components"] if c["name"] != "torch"]
    original = [d for d in client.referrers("envbuild", published["digest"], "application/vnd.cyclonedx+json")]
    subject, _ = client.manifest("envbuild", published["digest"])
    client.attach("envbuild", subject, "application/vnd.cyclonedx+json",
                  [Blob("application/vnd.cyclonedx+json", "sbom.cdx.json", data=json.dumps(sbom).encode())])
    _drop_from_index(client, published["digest"], {d.digest for d in original})
    try:
        r = _verify(published, env, keys["ours"][1])
        assert r.returncode == 1
        line = next(x for x in r.stdout.splitlines() if " sbom " in f" {x} ")
        assert line.startswith("FAIL") and "is not the one the provenance signs" in line, r.stdout
        assert any(x.startswith("ok") and " signature " in f" {x} " for x in r.stdout.splitlines())
    finally:
        client.put_manifest("envbuild", tag, saved, OCI_INDEX)


def test_verify_fails_on_another_image_pushed_under_the_tag(published, env, keys, registry, client):
    from envbuild.oci.registry import OCI_INDEX

    desc, saved = client.manifest("envbuild", published["tag"])
    try:
        _push_base(registry, f"{registry['host']}/envbuild:{published['tag']}")
        r = _verify(published, env, keys["ours"][1])
        assert r.returncode == 1 and "FAIL signature" in r.stdout and "unsigned image" in r.stdout, r.stdout
    finally:
        client.put_manifest("envbuild", published["tag"], saved, desc.media_type or OCI_INDEX)
    assert _verify(published, env, keys["ours"][1], "--no-pull").returncode == 0


def test_verify_fails_on_a_foreign_signature(published, env, keys, registry, client):
    """The provenance attached is signed, but by someone else's key (ours removed)."""
    from envbuild.supply import provenance
    from envbuild.oci.artifacts import Blob
    from envbuild.oci.registry import OCI_INDEX

    tag, saved = _index(client, published["digest"])
    statement = json.loads((published["out"] / "attestations" / "h20-ib" / "provenance.json").read_text())
    foreign = provenance.sign(statement, provenance.load_signer(str(keys["theirs"][0])))
    ours = client.referrers("envbuild", published["digest"], provenance.DSSE_MEDIA_TYPE)
    subject, _ = client.manifest("envbuild", published["digest"])
    client.attach("envbuild", subject, provenance.DSSE_MEDIA_TYPE,
                  [Blob(provenance.DSSE_MEDIA_TYPE, "provenance.dsse.json", data=foreign)])
    _drop_from_index(client, published["digest"], {d.digest for d in ours})
    try:
        r = _verify(published, env, keys["ours"][1], "--no-pull")
        assert r.returncode == 1 and "FAIL signature" in r.stdout and "not by the given key" in r.stdout, r.stdout
        assert json.loads(base64.b64decode(json.loads(foreign)["payload"])) == statement  # the same statement
    finally:
        client.put_manifest("envbuild", tag, saved, OCI_INDEX)


def test_an_unsigned_image_fails_verify_and_stage_exports_it_where_no_sqsh_is_published(env, keys, registry, work):
    plain = f"{registry['host']}/envbuild-plain:1"
    _push_base(registry, plain)
    r = run_cli("verify", plain, "--key", str(keys["ours"][1]), env=env, timeout=600)
    assert r.returncode == 1 and "(unsigned image)" in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr
    staged = work / "staged-plain"
    staged.mkdir()
    r = run_cli("stage", plain, "--to", str(staged), "--key", str(keys["ours"][1]), env=env, timeout=600)
    assert r.returncode == 1 and "(unsigned image)" in r.stderr and not list(staged.iterdir()), r.stderr
    r = run_cli("stage", plain, "--to", str(staged), "--unverified", env=env, timeout=900)
    assert r.returncode == 0, r.stderr
    assert "UNVERIFIED: staging" in r.stderr and "no .sqsh is published beside" in r.stderr and "exporting it here" in r.stderr
    assert len(list(staged.glob("*.sqsh"))) == 1


def test_stage_fetches_the_published_sqsh_by_digest(published, env, work, keys):
    staged = work / "staged"
    staged.mkdir()
    r = run_cli("stage", published["ref"], "--to", str(staged), "--key", str(keys["ours"][1]), env=env, timeout=1800)
    assert r.returncode == 0, r.stderr
    assert "fetching the signed .sqsh" in r.stderr and "exporting" not in r.stderr
    files = list(staged.glob("*.sqsh"))
    statement = json.loads((published["out"] / "attestations" / "h20-ib" / "provenance.json").read_text())
    sqsh = next(b for b in statement["predicate"]["runDetails"]["byproducts"] if b["name"] == "image.sqsh")
    assert len(files) == 1 and hashlib.sha256(files[0].read_bytes()).hexdigest() == sqsh["digest"]["sha256"]
    again = run_cli("stage", published["ref"], "--to", str(staged), "--key", str(keys["ours"][1]), env=env,
                    timeout=600)
    assert again.returncode == 0 and again.stdout.startswith("already staged")
    files[0].unlink()


def test_an_artifact_larger_than_its_declared_size_is_refused(published, registry, client):
    from envbuild.oci.artifacts import Descriptor
    from envbuild.base.errors import EnvbuildError

    art = client.referrers("envbuild", published["digest"], "application/vnd.envbuild.smoke-record.v1+json")[0]
    layer = client.layers("envbuild", art)[0]
    assert json.loads(client.fetch("envbuild", layer))["ok"] is True
    with pytest.raises(EnvbuildError, match="larger than the .* its descriptor declares"):
        client.fetch("envbuild", Descriptor(layer.media_type, layer.digest, layer.size - 1))


def test_the_manifest_job_refuses_a_digest_without_signed_provenance(published, env, keys, registry, client, work):
    """A digest handed on for an image nobody signed: the tag is not published."""
    _push_base(registry, f"{registry['host']}/envbuild:unsigned-amd64")
    digest = client.manifest("envbuild", "unsigned-amd64")[0].digest
    digests = work / "forged-digests"
    digests.mkdir()
    (digests / f"{published['tag']}-amd64").write_text(digest + "\n")
    before = client.manifest("envbuild", published["tag"])[0].digest
    r = run_cli("publish", "--manifest", published["tag"], "--registry", registry["host"], "--digests", str(digests),
                "--key", str(keys["ours"][1]), "--signing-key", str(keys["ours"][0]), "--matrix-dir",
                str(published["matrix"]), env=env, timeout=600)
    assert r.returncode == 1 and "is not signed as it must be" in r.stderr, r.stderr
    assert client.manifest("envbuild", published["tag"])[0].digest == before


def test_a_vulnerable_pin_stops_the_job_before_anything_is_built_or_pushed(env, keys, registry, client, work):
    """pycrypto 2.6.1 (PYSEC-2017-94, PYSEC-2018-97) in the stack's lock: the job audits the lock
    first, names the advisories, builds nothing and pushes nothing."""
    matrix = _matrix(work, registry["host"], "vulnerable")
    lock = matrix / "locks" / f"{STACK}.x86_64.txt"
    lock.write_text(lock.read_text().replace("# [venv]\n", "# [venv]\npycrypto==2.6.1 \\\n    --hash=sha256:"
                                             "f2ce1e989b272cfcb677616763e0a2e7ec659effa67a88aa92b3a65528f60a3c\n"))
    out = work / "vulnerable-out"
    r = run_cli("publish", "--job", JOB, "--registry", registry["host"], "--signing-key", str(keys["ours"][0]),
                "--matrix-dir", str(matrix), "--out", str(out), *BUILD_ARGS, env=env, timeout=900)
    assert r.returncode == 1, r.stdout + r.stderr
    said = " ".join(r.stdout.split())
    assert "FAILED h20:ib: at audit:" in said and "PYSEC-2017-94" in said and "PYSEC-2018-97" in said
    assert not (out / "build").exists() and not (out / "digests").exists()
    (matrix / "vulnerabilities.yaml").write_text(
        "allow:\n  - id: PYSEC-2017-94\n    reason: fixture\n    expires: 2020-01-01\n"
        "  - id: PYSEC-2018-97\n    reason: fixture\n    expires: 2020-01-01\n")
    r = run_cli("publish", "--job", JOB, "--registry", registry["host"], "--signing-key", str(keys["ours"][0]),
                "--matrix-dir", str(matrix), "--out", str(out), *BUILD_ARGS, env=env, timeout=900)
    assert r.returncode == 1 and "expired on 2020-01-01" in " ".join(r.stdout.split())


def test_what_a_failed_variant_attached_is_taken_back(registry, client):
    """After the image was pushed, a later step failed: its attachments leave the referrers index
    and the image's manifest is deleted (this registry allows deletes), unless an earlier publish
    of the same bits is still attached to it."""
    from envbuild.oci.artifacts import Blob
    from envbuild.supply.release import _take_back

    _push_base(registry, f"{registry['host']}/envbuild-takeback:1")
    subject, _ = client.manifest("envbuild-takeback", "1")
    earlier = client.attach("envbuild-takeback", subject, "application/x-test", [Blob("text/plain", "e", data=b"e")])
    attached = [client.attach("envbuild-takeback", subject, "application/x-test", [Blob("text/plain", "a", data=b"a")])
                .digest]
    kept = _take_back(client, "envbuild-takeback", subject.digest, attached)  # the same bits, published before
    assert len(kept) == 1 and "kept: an earlier publish" in kept[0] and client.exists("envbuild-takeback", "1")
    assert [d.digest for d in client.referrers("envbuild-takeback", subject.digest)] == [earlier.digest]
    assert _take_back(client, "envbuild-takeback", subject.digest, [earlier.digest]) == []
    assert client.referrers("envbuild-takeback", subject.digest) == []
    assert not client.exists("envbuild-takeback", "1") and not client.exists("envbuild-takeback", subject.digest)
