"""`verify` against a registry serving anything (hypothesis): any value of any document it reads
(the referrers index, a manifest, the config, the smoke record, the signed provenance itself)
replaced by a wrong type, deep nesting, a 5,000-digit integer or a string with a newline is a
FAIL or exit 2 in one paragraph naming the document; never a traceback, never VERIFIED for what
was changed. The registry, and what the property found on main, are tests/behaviour/test_verify_trust.py."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envbuild.supply import provenance
from envbuild.base.errors import EnvbuildError
from envbuild.supply.verify import Trust
from property_settings import examples
from test_supply_chain import inventory, keys  # noqa: F401  (the module's real keys and inventory)
from test_verify_trust import (MemoryRegistry, TAG, _checks, _documents, _replaced, _repoint, _sign_raw, _statement,
                               push_signed)

# What a document's value may be replaced by: a wrong type, deep nesting, a 5,000-digit integer,
# a reference with a newline, a path.
HOSTILE_VALUES = st.sampled_from([
    None, True, 7, -1, 1.5, "", "x", [], {}, [1, [2]], {"a": {}}, "sha256:" + "a" * 64 + "\n",
    "a\nRUN touch /PWNED", "../../etc/passwd", "sha256:../../x", "linux/amd64\n",
    "RAW:" + "[" * 100 + "]" * 100, "RAW:" + "9" * 5000, "RAW:{\"a\": NaN}", "RAW:\"\\ud800\""])


def _paths(doc, prefix=()):
    """Every path to a value in a JSON document."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


@pytest.mark.parametrize("kind", ["registry documents", "envelope payload"])
def test_a_hostile_referrers_index_manifest_or_provenance_is_exit_2_naming_the_field(keys, inventory, kind):  # noqa: F811
    """Any value of any document the registry serves replaced by a wrong type, deep nesting, a
    5,000-digit integer or a string with a newline: verify says FAIL or refuses with exit 2 in
    one paragraph naming the document; never a traceback, never VERIFIED for what was changed."""
    client = MemoryRegistry()
    push_signed(client, TAG, keys["ed25519"][0], inventory)
    trust = Trust(key=provenance.load_public_key(str(keys["ed25519"][1])))
    pristine = dict(client.store)
    documents = _documents(client, trust)
    envelope_path = next(p for p in documents if json.loads(pristine[p][1]).get("payloadType"))

    @settings(max_examples=examples(12), deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(data=st.data(), value=HOSTILE_VALUES)
    def prop(data, value):
        client.store = dict(pristine)
        if kind == "envelope payload":  # signed by the trusted key: the signature holds, the content is hostile
            stmt = _statement(pristine[envelope_path][1])
            path = data.draw(st.sampled_from(list(_paths(stmt))))
            payload = _replaced(stmt, path, value)
            try:  # the envelope is read after its digest is checked: parsed as open_envelope reads it
                provenance.open_envelope(_sign_raw(payload, keys["ed25519"][0]), trust.key)
            except EnvbuildError as e:
                assert e.exit_code in (1, 2) and "\n" not in e.message, e.message
                assert e.exit_code == 1 or "field" in e.message or "nests deeper" in e.message \
                    or "digits" in e.message or "not finite" in e.message or "not valid JSON" in e.message, e.message
            return
        else:
            where = data.draw(st.sampled_from(documents))
            doc = json.loads(pristine[where][1])
            path = data.draw(st.sampled_from(list(_paths(doc))))
            changed = _replaced(doc, path, value)
            if changed == _replaced(doc, path, _at(doc, path)):
                return
            client.store[where] = (pristine[where][0], changed)
            _repoint(client, pristine, where, changed)
        try:
            checks = _checks(client, TAG, trust)
        except EnvbuildError as e:
            assert e.exit_code in (1, 2) and "\n" not in e.message, e.message
            if e.exit_code == 2:
                assert any(w in e.message for w in ("field", "nests deeper", "digits", "not valid JSON", "not finite",
                                                    "not UTF-8", "serves no")), e.message
            return
        assert not all(c.ok for c in checks.values()) or _harmless(path, value), (path, value)

    prop()


def _at(doc, path):
    for part in path:
        doc = doc[part]
    return doc


def _harmless(path: tuple, value) -> bool:
    """A change no check depends on: an annotation, a field verify does not read, a value equal
    in meaning (a title, the statement's builder or metadata)."""
    text = "/".join(map(str, path))
    return any(w in text for w in ("annotations", "metadata", "builder", "request", "schemaVersion", "nonce",
                                   "image", "stack", "checked_at", "mode", "uri", "startedOn", "finishedOn",
                                   "resolvedDependencies", "_type", "name")) or not path
