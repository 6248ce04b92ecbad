"""`verify` and `stage` decide by the signed statement only (issue 40): the tag matched exactly
against the provenance's, each byproduct chosen by the digest the provenance lists and an
unsigned one beside it a failure, a published image staged only with a key (or said unverified),
and what a registry serves parsed bounded and checked (exit 2 naming the field, never a
traceback).

The registry is `MemoryRegistry`, a fake (said so): envbuild's own artifacts client with its
HTTP transport replaced by a dictionary, so every byte verify reads is what the test put there.
tests/docker/test_verify_trust_docker.py does the same against the local registry 127.0.0.1:5000."""

from __future__ import annotations

import hashlib
import json

import pytest
import requests

from conftest import FIXTURE_MATRIX, run_here
from envbuild.supply import provenance
from envbuild.supply import sbom
from envbuild.oci.artifacts import Blob, Descriptor, Registry
from envbuild.builds.staging import SQSH_TYPE
from envbuild.base.errors import EnvbuildError
from envbuild.oci.registry import OCI_MANIFEST
from envbuild.supply.verify import SMOKE_TYPE, Trust, signed_sqsh, targets, verify_target
from test_supply_chain import inventory, keys  # noqa: F401  (the module's real keys and inventory)

TAG = "torch2.15-cu132-py3.11-h20"
REPO = "envbuild"


class MemoryRegistry(Registry):
    """The artifacts client over a dictionary (a fake: no network), as the distribution spec's
    fallback registry answers (no referrers API: the sha256-<hex> index)."""

    def __init__(self, host: str = "127.0.0.1:9"):
        self.host, self.base, self.timeout, self._auth_loaded = host, f"http://{host}", 1, True
        self.store: dict[str, tuple[str, bytes]] = {}
        self.reads: set[str] = set()
        self.client = self  # oras's interface: get_container, do_request

    def get_container(self, ref):
        return ref

    def do_request(self, url, method="GET", data=None, headers=None, json=None, stream=False):
        path = url[len(self.base):]
        if method == "PUT":
            kind = (headers or {}).get("Content-Type", "")
            self.store[path] = (kind, data)
            self.store[path.rsplit("/", 1)[0] + "/sha256:" + hashlib.sha256(data).hexdigest()] = (kind, data)
        found = self.store.get(path) if method in ("GET", "HEAD") else ("", b"")
        self.reads.add(path)
        r = requests.Response()
        r.status_code = 201 if method == "PUT" else 200 if found else 404
        r.headers["Content-Type"] = found[0] if found else "text/plain"
        r._content, r._content_consumed = (found[1] if found and method == "GET" else b""), True
        return r

    def upload(self, name, blob):
        data = blob.data if blob.data is not None else blob.path.read_bytes()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        self.store[f"/v2/{name}/blobs/{digest}"] = ("application/octet-stream", data)
        return Descriptor(blob.media_type, digest, len(data), annotations={"org.opencontainers.image.title": blob.title}
                          if blob.title else {})


def push_signed(client: Registry, tag: str, key, inv: dict, sqsh: bytes = b"hsqs signed bytes",
                smoke_ok: bool = True) -> dict:
    """An image (manifest and config, no layers) under `tag`, its SBOM, smoke record and .sqsh
    attached and a provenance signed with `key` listing them: what `envbuild publish` leaves."""
    config = client.upload(REPO, Blob("application/vnd.oci.image.config.v1+json", "",
                                      data=json.dumps({"os": "linux", "architecture": "amd64",
                                                       "nonce": tag}).encode()))
    body = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": config.to_dict(), "layers": []}).encode()
    client.put_manifest(REPO, tag, body, OCI_MANIFEST)
    subject = Descriptor(OCI_MANIFEST, "sha256:" + hashlib.sha256(body).hexdigest(), len(body))
    inv = {**inv, "image_id": config.digest}
    files = {sbom.MEDIA_TYPE: (sbom.FILE_NAME, sbom.to_json(sbom.make_bom(inv, f"{client.host}/{REPO}:{tag}"))),
             SMOKE_TYPE: ("smoke.json", json.dumps({"ok": smoke_ok, "image_id": config.digest, "platform": "linux/amd64",
                                                   "mode": "cpu", "checked_at": "2026-11-26T00:00:00Z"}).encode()),
             SQSH_TYPE: ("image.sqsh", sqsh)}
    for kind, (title, data) in files.items():
        client.attach(REPO, subject, kind, [Blob(kind, title, data=data)])
    manifest = json.dumps({"tag": tag, "platform": "linux/amd64", "stack": "s", "base_images": {}}).encode()
    stmt = provenance.statement(f"{client.host}/{REPO}:{tag}", subject.digest, {"gpu": "h20"}, manifest,
                                FIXTURE_MATRIX, [{"name": n, "digest": {"sha256": hashlib.sha256(d).hexdigest()}}
                                                 for n, d in files.values()], "2026-11-26T00:00:00Z")
    client.attach(REPO, subject, provenance.DSSE_MEDIA_TYPE,
                  [Blob(provenance.DSSE_MEDIA_TYPE, "provenance.dsse.json",
                        data=provenance.sign(stmt, provenance.load_signer(str(key))))])
    return {"subject": subject, "body": body, "config": config.digest, "sqsh": files[SQSH_TYPE][1]}


def attach_unsigned_sqsh_first(client: Registry, subject: Descriptor) -> str:
    """What the issue's reproducer did: an unsigned .sqsh attached, listed ahead of the signed one."""
    from envbuild.oci.artifacts import fallback_tag
    from envbuild.oci.registry import OCI_INDEX

    extra = client.attach(REPO, subject, SQSH_TYPE, [Blob(SQSH_TYPE, "image.sqsh", data=b"hsqs UNSIGNED")])
    _, body = client.manifest(REPO, fallback_tag(subject.digest))
    index = json.loads(body)
    index["manifests"].sort(key=lambda m: m["digest"] != extra.digest)  # the unsigned one first
    client.put_manifest(REPO, fallback_tag(subject.digest), json.dumps(index).encode(), OCI_INDEX)
    return "sha256:" + hashlib.sha256(b"hsqs UNSIGNED").hexdigest()


@pytest.fixture(scope="module")
def published(keys, inventory):  # noqa: F811
    """The signed tag in memory, made once (a provenance reads the matrix and git): each test copies it."""
    client = MemoryRegistry()
    pushed = push_signed(client, TAG, keys["ed25519"][0], inventory)
    pushed["documents"] = _documents(client, Trust(key=provenance.load_public_key(str(keys["ed25519"][1]))))
    return dict(client.store), pushed


@pytest.fixture
def signed(keys, published):  # noqa: F811
    client = MemoryRegistry()
    client.store = dict(published[0])
    return client, published[1], Trust(key=provenance.load_public_key(str(keys["ed25519"][1])))


def _checks(client, tag, trust) -> dict:
    (target,) = targets(client, client.host, REPO, tag)
    return {c.name: c for c in verify_target(client, target, trust, content=False)}


def test_the_signed_tag_verifies_and_its_per_platform_tag_too(signed):
    client, pushed, trust = signed
    for tag in (TAG, f"{TAG}-amd64"):
        client.put_manifest(REPO, tag, pushed["body"], OCI_MANIFEST)
        checks = _checks(client, tag, trust)
        assert all(c.ok for c in checks.values()), [c.line() for c in checks.values()]


@pytest.mark.parametrize("sibling", ["-efa", "-fa2.8.3.post2", "-arm64", "x"])
def test_the_signed_image_under_a_sibling_variants_tag_fails_verify(signed, sibling):
    """CI publishes TAG-efa and TAG-fa2.8.3.post2 for other variants: the h20 image pushed under
    one is not what the provenance vouches for (the old prefix match verified it)."""
    client, pushed, trust = signed
    client.put_manifest(REPO, TAG + sibling, pushed["body"], OCI_MANIFEST)
    check = _checks(client, TAG + sibling, trust)["provenance"]
    assert check.ok is False and f"not {TAG}{sibling}" in check.detail, check.line()


def test_an_unsigned_sqsh_beside_the_signed_one_fails_naming_both_and_stage_refuses(signed, monkeypatch):
    client, pushed, trust = signed
    unsigned = attach_unsigned_sqsh_first(client, pushed["subject"])
    signed_digest = "sha256:" + hashlib.sha256(pushed["sqsh"]).hexdigest()
    check = _checks(client, TAG, trust)["sqsh"]
    assert check.ok is False and unsigned in check.detail and signed_digest in check.detail, check.line()
    monkeypatch.setattr("envbuild.supply.verify.registry_client", lambda host: client)
    with pytest.raises(EnvbuildError) as e:
        signed_sqsh(f"{client.host}/{REPO}:{TAG}", trust)
    assert e.value.exit_code == 1 and unsigned in e.value.message and signed_digest in e.value.message


def test_stage_takes_the_sqsh_the_provenance_names(signed, monkeypatch):
    client, pushed, trust = signed
    monkeypatch.setattr("envbuild.supply.verify.registry_client", lambda host: client)
    found = signed_sqsh(f"{client.host}/{REPO}:{TAG}", trust)
    assert found.layer.digest == "sha256:" + hashlib.sha256(pushed["sqsh"]).hexdigest()
    assert found.image_id == pushed["config"]
    client.put_manifest(REPO, f"{TAG}-efa", pushed["body"], OCI_MANIFEST)
    with pytest.raises(EnvbuildError, match=f"not {TAG}-efa"):
        signed_sqsh(f"{client.host}/{REPO}:{TAG}-efa", trust)


def test_stage_of_a_published_image_wants_a_key_or_says_it_is_unverified(tmp_path, keys):  # noqa: F811
    """Checked before any registry is asked (127.0.0.1:9 refuses connections: exit 1 after it)."""
    ref = "127.0.0.1:9/acme/envbuild:t"
    r = run_here("stage", ref, "--to", str(tmp_path))
    assert r.returncode == 2 and "--key FILE" in r.stderr and "--unverified" in r.stderr, r.stderr
    r = run_here("stage", ref, "--to", str(tmp_path), "--unverified")
    assert r.returncode == 1 and "UNVERIFIED: staging" in r.stderr and "cannot be reached" in r.stderr, r.stderr
    r = run_here("stage", ref, "--to", str(tmp_path / "nope"), "--key", str(keys["ed25519"][1]))
    assert r.returncode == 2 and "does not exist" in r.stderr, r.stderr
    r = run_here("stage", ref, "--to", str(tmp_path), "--key", str(keys["ed25519"][1]), "--unverified")
    assert r.returncode == 2 and "give one" in r.stderr, r.stderr
    r = run_here("verify", ref, "--key", str(keys["ed25519"][1]), "--platform", "linux/amd64\n")
    assert r.returncode == 2 and "--platform 'linux/amd64\\n' is not a platform" in r.stderr, r.stderr


# ---------------------------------------------------------------- hostile documents


def _replaced(doc, path, value) -> bytes:
    if not path:
        return value[4:].encode() if isinstance(value, str) and value.startswith("RAW:") else json.dumps(value).encode()
    doc = json.loads(json.dumps(doc))
    node = doc
    for part in path[:-1]:
        node = node[part]
    marker = "\x00MARK\x00"
    node[path[-1]] = marker if isinstance(value, str) and value.startswith("RAW:") else value
    text = json.dumps(doc)
    return text.replace(json.dumps(marker), value[4:]).encode() if isinstance(value, str) and \
        value.startswith("RAW:") else text.encode()


def _documents(client: MemoryRegistry, trust: Trust) -> list[str]:
    """The store's JSON documents verify reads: the tag's manifest, the referrers index, each
    artifact's manifest, the config, the envelope, the smoke record."""
    client.reads.clear()
    assert all(c.ok for c in _checks(client, TAG, trust).values())
    out = []
    for path, (_, data) in client.store.items():
        if path not in client.reads:
            continue
        try:
            json.loads(data)
        except ValueError:
            continue
        out.append(path)
    return sorted(out)


# Each was a traceback (AttributeError, TypeError, ValueError) or a digest with a newline carried on, on main.
FOUND = [("index", ("manifests", 0), 1, "manifests[0]"), ("index", ("manifests", 0, "size"), "RAW:" + "9" * 5000,
                                                          "5000 digits"),
         ("index", ("manifests", 0, "digest"), "sha256:" + "a" * 64 + "\n", "manifests[0].digest"),
         ("index", ("manifests",), "RAW:" + "[" * 100 + "]" * 100, "nests deeper"),
         ("envelope", ("signatures",), {"a": 1}, "signatures"),
         ("payload", ("predicate", "runDetails", "byproducts", 0, "digest"), [], "byproducts[0].digest")]


@pytest.mark.parametrize("which, path, value, named", FOUND, ids=[f"{w}:{n}" for w, _, _, n in FOUND])
def test_what_a_hostile_registry_served_on_main_is_exit_2_naming_the_field(keys, signed, which, path, value,  # noqa: F811
                                                                          named):
    client, pushed, trust = signed
    pristine = dict(client.store)
    docs = {p: json.loads(v[1]) for p, v in pristine.items() if p in pushed["documents"]}
    where = next(p for p, d in docs.items() if {"index": "manifests" in d and "/manifests/sha256-" in p,
                                                  "config": d.get("os") == "linux", "envelope": "payloadType" in d,
                                                  "payload": "payloadType" in d}[which])
    if which == "payload":
        changed = _sign_raw(_replaced(_statement(pristine[where][1]), path, value), keys["ed25519"][0])
    else:
        changed = _replaced(docs[where], path, value)
    if which in ("envelope", "payload"):  # read after its digest is checked: what a key-holder or a signer wrote
        with pytest.raises(EnvbuildError) as e:
            provenance.open_envelope(changed, trust.key)
        assert e.value.exit_code == 2 and named in e.value.message, e.value.message
        return
    client.store[where] = (pristine[where][0], changed)
    if which == "config":  # served under its digest as a registry that does not check would
        _repoint(client, pristine, where, changed)
        client.store[where] = (pristine[where][0], changed)
    with pytest.raises(EnvbuildError) as e:
        _checks(client, TAG, trust)
    assert e.value.exit_code in ((1, 2) if which == "config" else (2,)) and "\n" not in e.value.message, e.value.message
    assert which == "config" or named in e.value.message, e.value.message


def _statement(envelope: bytes) -> dict:
    import base64

    return json.loads(base64.b64decode(json.loads(envelope)["payload"]))


def _sign_raw(payload: bytes, key) -> bytes:
    """A DSSE envelope of `payload` bytes as they are (not re-serialized), signed with `key`."""
    from securesystemslib.dsse import Envelope

    envelope = Envelope(payload=payload, payload_type=provenance.PAYLOAD_TYPE, signatures={})
    envelope.sign(provenance.load_signer(str(key)))
    return json.dumps(envelope.to_dict()).encode()


def _repoint(client: MemoryRegistry, pristine: dict, where: str, changed: bytes) -> None:
    """A changed blob is served under its old digest (the fetch's own check refuses it: exit 1);
    a changed manifest under its name too, so what reads it by tag or digest gets it."""
    for path, value in pristine.items():
        if value[1] == pristine[where][1]:
            client.store[path] = (value[0], changed)
