"""The vulnerability gate against PyPI itself (marked `network`): the fixture advisories of
tests/behaviour/test_audit.py are what PyPI says about pycrypto 2.6.1, and pip-audit against
PyPI finds them where PyPI's per-release JSON answers, or reports the pins as not audited."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytestmark = pytest.mark.network


def test_pypi_serves_the_fixture_advisories_for_pycrypto_2_6_1():
    """The fixture records are what PyPI itself says about pycrypto 2.6.1 (its last release, so
    the project's JSON lists them)."""
    with urllib.request.urlopen("https://pypi.org/pypi/pycrypto/json", timeout=60) as response:
        data = json.load(response)
    assert data["info"]["version"] == "2.6.1"
    ids = {v["id"] for v in data["vulnerabilities"]}
    assert {"PYSEC-2017-94", "PYSEC-2018-97"} <= ids


def test_pip_audit_against_pypi_itself():
    """Where PyPI's per-release JSON answers (GitHub's runners), pip-audit finds the advisory
    there; where it answers 404 (this machine's network), the packages are reported as not
    audited, never as clean."""
    from envbuild.supply.audit import audit_pins

    result = audit_pins({"pycrypto": "2.6.1"}, "a pin", "pypi", [])
    if result.unaudited:
        assert not result.ok and "could not be audited" in result.refusal("a pin")
    else:
        assert "PYSEC-2017-94" in {f.id for f in result.findings} and not result.ok
