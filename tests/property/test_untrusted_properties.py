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
