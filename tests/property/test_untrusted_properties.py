"""Redaction of URL credentials, for any user and secret (hypothesis): none survives. The parser of
untrusted documents is tests/unit/test_untrusted.py."""

from hypothesis import given, settings, strategies as st

from envbuild.base.grammar import redact
from property_settings import EXAMPLES


@settings(max_examples=EXAMPLES, deadline=None, database=None)
@given(user=st.text(alphabet=st.characters(blacklist_characters="/@ \t\n'\"", blacklist_categories=("Cs",)),
                    min_size=1, max_size=20),
       secret=st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.~%", min_size=6, max_size=30))
def test_no_url_credential_survives_redaction(user, secret):
    for url in (f"https://{user}:{secret}@host.example/v1/", f"http://{secret}@10.0.0.1:5000/x",
                f"https://host.example/api?x=1&token={secret}&y=2"):
        shown = redact(f"could not reach {url}: refused")
        assert secret not in shown and ("host.example" in shown or "10.0.0.1" in shown)


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                     st.text(max_size=12), st.sampled_from(["yes", "no", "0x1f", "1e3", "~", "2026-11-29", "- a", "a: b"]))
_DOCUMENTS = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                             st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                          max_leaves=20)


@settings(max_examples=EXAMPLES * 4, deadline=None, database=None)
@given(doc=_DOCUMENTS, flow=st.sampled_from([None, True, False]), cut=st.integers(min_value=0, max_value=400),
       noise=st.text(alphabet="[]{}:,-#&*!|>'\"\n \t?%@`", max_size=6))
def test_libyaml_and_the_bounded_loader_agree_on_any_text(doc, flow, cut, noise):
    """parse_yaml reads with libyaml where it can: for any text (a dumped document, cut anywhere,
    with YAML's indicators spliced in) that the bounded pure-Python loader reads, it gives that
    loader's value. Where that loader refuses, it refuses too, or gives libyaml's value: libyaml
    takes a few texts PyYAML's scanner does not (`[n?ull]`: a '?' inside a plain scalar in a flow
    collection, which the YAML spec allows), never with an alias or past the depth bound."""
    import yaml

    from envbuild.base import files
    from envbuild.base.errors import EnvbuildError

    text = yaml.safe_dump(doc, default_flow_style=flow, allow_unicode=True)
    text = text[:cut] + noise + text[cut:]
    try:
        expected = yaml.load(text, Loader=files._BoundedLoader)  # noqa: S506  (a SafeLoader)
    except (yaml.YAMLError, ValueError, RecursionError):
        try:
            got = files.parse_yaml(text, "a.yaml")
        except EnvbuildError:
            return
        assert got == yaml.load(text, Loader=yaml.CSafeLoader), text  # noqa: S506  (a safe loader)
        return
    assert files.parse_yaml(text, "a.yaml") == expected, text
