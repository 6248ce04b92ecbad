"""A republish hands on a variant the registry already serves from the same rendered files
(envbuild/supply/published.py, issue "cost at matrix scale"), and only then: the image's provenance
signed by the job's own key, every byproduct it lists attached, its smoke record passed, the
manifest.json it records equal to the one rendered now, and its SBOM's pins audited again.

The registry is test_verify_trust's `MemoryRegistry`, a fake (said so): envbuild's own artifacts
client with its HTTP transport replaced by a dictionary. The advisories are real (the local OSV
endpoint of tests/tools/osv_server.py). The job against a real registry, building nothing on
its second run, is tests/docker/test_publish_job.py."""

from __future__ import annotations

import json
import sys

import pytest

from envbuild.supply import provenance

from envbuild.supply import published

from envbuild.supply import release
from envbuild.supply import signing
from envbuild.supply.jobplan import outcome_lines

from envbuild.supply import sbom
from envbuild.knowledge.matrix import load_matrix
from envbuild.base.errors import EnvbuildError
from envbuild.supply.verify import Trust
from conftest import ROOT
from test_supply_chain import inventory, keys  # noqa: F401  (the module's real keys and inventory)
from test_verify_trust import REPO, TAG, MemoryRegistry, push_signed

sys.path.insert(0, str(ROOT / "tests" / "tools"))
from osv_server import OsvServer  # noqa: E402

PLATFORM_TAG = f"{TAG}-amd64"


def _manifest(tag: str) -> bytes:
    """The manifest.json push_signed's provenance records (the bytes rendered for the variant)."""
    return json.dumps({"tag": tag, "platform": "linux/amd64", "stack": "s", "base_images": {}}).encode()


@pytest.fixture
def registry(keys, inventory, monkeypatch):  # noqa: F811
    """A published variant under its per-platform tag, signed with the ed25519 key."""
    client = MemoryRegistry()
    pushed = push_signed(client, PLATFORM_TAG, keys["ed25519"][0], inventory)
    monkeypatch.setattr(published, "Registry", lambda host: client)
    return client, pushed


def _trust(keys, which="ed25519") -> Trust:  # noqa: F811
    return Trust(key=provenance.load_public_key(str(keys[which][1])))


def test_the_same_rendered_files_signed_by_the_jobs_key_are_handed_on(registry, keys, inventory):  # noqa: F811
    client, pushed = registry
    earlier, why = published.find(f"{client.host}/{REPO}", PLATFORM_TAG, "linux/amd64", _manifest(PLATFORM_TAG),
                                  _trust(keys))
    assert earlier is not None, why
    assert earlier.digest == pushed["subject"].digest and earlier.config == pushed["config"]
    assert earlier.pins == sbom.python_pins(inventory)  # what the gate audits when it builds
    assert "same rendered files" in why and "smoke test passed" in why


@pytest.mark.parametrize("case", ["other files", "other key", "not published", "no trust", "other platform",
                                  "failed smoke"])
def test_anything_less_is_built_and_says_why(registry, keys, inventory, case):  # noqa: F811
    client, pushed = registry
    manifest, trust, tag, platform = _manifest(PLATFORM_TAG), _trust(keys), PLATFORM_TAG, "linux/amd64"
    if case == "other files":
        manifest = manifest.replace(b'"stack": "s"', b'"stack": "t"')
    elif case == "other key":
        trust = _trust(keys, "ecdsa")
    elif case == "not published":
        tag = f"{TAG}-arm64"
    elif case == "no trust":
        trust = None
    elif case == "other platform":
        platform = "linux/arm64"
    else:  # the same image published again with a smoke record that failed, signed: the newest statement is read
        client.store = {k: v for k, v in client.store.items() if "sha256-" not in k}  # its attachments gone
        push_signed(client, PLATFORM_TAG, keys["ed25519"][0], inventory, smoke_ok=False)
    earlier, why = published.find(f"{client.host}/{REPO}", tag, platform, manifest, trust)
    assert earlier is None
    expected = {"other files": "published from other rendered files", "other key": "signature check failed",
                "not published": "is not published yet", "no trust": "no key or workflow identity",
                "other platform": "could not be checked", "failed smoke": "smoke check failed"}[case]
    assert expected in why, why


def _job(tmp_path, client, found, service, calls) -> list:
    """run_job of one variant whose registry answer is `found`; `calls` records builds."""
    m = load_matrix()
    job = {"id": "j", "stack": "torch2.15-cu132-py3.11-pypi", "platform": "linux/amd64", "extensions": ""}
    variant = {"variant": "h20:ib:", "tag": TAG, "platform": "linux/amd64", "gpu": "h20", "stack": job["stack"],
               "fabric": "ib"}

    def render(v, build_dir):
        build_dir.mkdir(parents=True, exist_ok=True)
        (build_dir / "manifest.json").write_bytes(_manifest(PLATFORM_TAG))
        return build_dir

    def build(v, build_dir):
        calls.append(v["variant"])
        raise EnvbuildError("stand-in build: not reached when the variant is handed on", exit_code=1)

    ctx = release.JobContext(m, client.host, f"{client.host}/{REPO}", tmp_path, signing.Signing(), service, build,
                             render=render, trust=found)
    return release.run_job(ctx, job, [variant])


def test_the_job_hands_the_digest_on_and_builds_nothing(registry, keys, tmp_path, monkeypatch):  # noqa: F811
    client, pushed = registry
    monkeypatch.setattr(release, "audit_stack", lambda *a, **k: None)  # the lock audit: tested in test_audit.py
    monkeypatch.setattr(release, "get_engine", lambda: None)
    calls: list = []
    with OsvServer() as osv:
        (o,) = _job(tmp_path, client, _trust(keys), osv.url, calls)
    assert o.ok and not calls, o.reason
    assert o.digest == pushed["subject"].digest and o.published_before.endswith(f"{REPO}:{PLATFORM_TAG}")
    assert (tmp_path / "digests" / PLATFORM_TAG).read_text() == pushed["subject"].digest + "\n"
    assert "build" not in o.seconds and {"published before", "audit"} <= set(o.seconds)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["outcomes"][0]["published_before"] == o.published_before
    assert outcome_lines([o], f"{client.host}/{REPO}")[0].startswith(f"unchanged h20:ib:  {client.host}/")

    calls.clear()
    (o,) = _job(tmp_path / "other-key", client, _trust(keys, "ecdsa"), "pypi", calls)
    assert calls == ["h20:ib:"] and not o.ok and o.failed_step == "build"  # not trusted: built


def test_a_pin_found_vulnerable_since_is_not_handed_on(keys, inventory, tmp_path, monkeypatch):  # noqa: F811
    """pycrypto 2.6.1 (PYSEC-2017-94) in the signed SBOM: the earlier image fails the audit it
    would fail if built now; nothing is handed on, nothing is built."""
    client = MemoryRegistry()
    inv = {**inventory, "python": [*inventory["python"], {"name": "pycrypto", "version": "2.6.1",
                                                         "location": "/opt/venv"}]}
    push_signed(client, PLATFORM_TAG, keys["ed25519"][0], inv)
    monkeypatch.setattr(published, "Registry", lambda host: client)
    monkeypatch.setattr(release, "audit_stack", lambda *a, **k: None)
    monkeypatch.setattr(release, "get_engine", lambda: None)
    calls: list = []
    with OsvServer() as osv:
        (o,) = _job(tmp_path, client, _trust(keys), osv.url, calls)
    assert not o.ok and o.failed_step == "audit" and "PYSEC-2017-94" in o.reason and not calls
    assert not (tmp_path / "digests").exists()


def test_republish_builds_what_is_published(registry, keys, tmp_path, monkeypatch):  # noqa: F811
    client, _ = registry
    monkeypatch.setattr(release, "audit_stack", lambda *a, **k: None)
    monkeypatch.setattr(release, "get_engine", lambda: None)
    calls: list = []
    m = load_matrix()
    ctx = release.JobContext(m, client.host, f"{client.host}/{REPO}", tmp_path, signing.Signing(), "pypi",
                             lambda v, d: calls.append(v) or (_ for _ in ()).throw(EnvbuildError("x")),
                             render=lambda v, d: pytest.fail("--republish renders in the build, not before it"),
                             trust=_trust(keys), republish=True)
    job = {"id": "j", "stack": "torch2.15-cu132-py3.11-pypi", "platform": "linux/amd64", "extensions": ""}
    (o,) = release.run_job(ctx, job, [{"variant": "h20:ib:", "tag": TAG, "platform": "linux/amd64", "gpu": "h20",
                                       "stack": job["stack"], "fabric": "ib"}])
    assert len(calls) == 1 and o.failed_step == "build"


def test_publish_trust_is_the_jobs_own_signer(keys, monkeypatch):  # noqa: F811
    signer = provenance.load_signer(str(keys["ed25519"][0]))
    assert signing.publish_trust(signing.Signing(signer=signer)).key.keyid == signer.public_key.keyid
    monkeypatch.delenv("GITHUB_WORKFLOW_REF", raising=False)
    assert signing.publish_trust(signing.Signing(keyless=True)) is None  # outside Actions: no identity to name
    monkeypatch.setenv("GITHUB_WORKFLOW_REF", "acme/envbuild/.github/workflows/publish.yml@refs/heads/main")
    assert "publish\\.yml@refs/heads/main" in signing.publish_trust(signing.Signing(keyless=True)).identity


@pytest.mark.parametrize("doc", [b"[" * 100_000 + b"]" * 100_000, b'{"n": ' + b"9" * 5000 + b"}", b"\xff\xfe"])
def test_an_sbom_is_parsed_bounded(doc):
    """The SBOM a registry serves is read within bounds (nesting, digits, text), exit 2 naming it,
    never a RecursionError: verify and a republish read it."""
    with pytest.raises(EnvbuildError, match="the SBOM") as e:
        sbom.describe(doc)
    assert e.value.exit_code == 2
