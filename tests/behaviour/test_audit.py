"""The vulnerability gate: real pip-audit, real advisories (PYSEC-2017-94 and PYSEC-2018-97 of
pycrypto 2.6.1, from the PyPA advisory database), served by a local OSV endpoint because PyPI's
per-release JSON answers 404 from this machine (tests/tools/osv_server.py says why); a fixture
lock holding the vulnerable pin; the matrix allowlist with live and expired entries."""

from __future__ import annotations

import datetime as dt
import shutil
import sys
from pathlib import Path

import pytest

from conftest import FIXTURE_MATRIX, ROOT, run_here, tree

sys.path.insert(0, str(ROOT / "tests" / "tools"))
from osv_server import OsvServer  # noqa: E402

STACK = "torch2.11-cu130-py3.12"
PYCRYPTO = ("pycrypto==2.6.1 \\\n    --hash=sha256:f2ce1e989b272cfcb677616763e0a2e7ec659effa67a88aa92b3a65528f60a3c\n"
            "    # via -r inputs (a fixture pin: https://pypi.org/project/pycrypto/2.6.1/)\n")


@pytest.fixture(scope="module")
def osv():
    with OsvServer() as server:
        yield server


@pytest.fixture
def vulnerable(tmp_path):
    """A matrix whose lock of STACK also pins pycrypto 2.6.1."""
    d = tmp_path / "matrices"
    shutil.copytree(FIXTURE_MATRIX, d)
    lock = d / "locks" / f"{STACK}.x86_64.txt"
    lock.write_text(lock.read_text().replace("# [venv]\n", "# [venv]\n" + PYCRYPTO))
    return d


def _allow(d: Path, *entries: str) -> None:
    (d / "vulnerabilities.yaml").write_text("allow:\n" + "".join(entries))


def entry(id_: str, expires: str, package: str = "pycrypto") -> str:
    return (f"  - id: {id_}\n    package: {package}\n    reason: \"only Crypto.Hash is imported, never the block "
            f"ciphers or ElGamal\"\n    expires: {expires}\n")


def test_a_vulnerable_pin_fails_with_the_advisory_id_and_nothing_is_written(vulnerable, osv):
    before = tree(vulnerable)
    r = run_here("audit", "--stack", STACK, "--matrix-dir", str(vulnerable), "--vulnerability-service", osv.url)
    assert r.returncode == 1, r.stdout + r.stderr
    said = " ".join(r.stderr.split())
    assert "PYSEC-2017-94 (CVE-2013-7459, GHSA-cq27-v7xp-c356) in pycrypto 2.6.1, no fixed release" in said
    assert "PYSEC-2018-97" in said and "matrices/vulnerabilities.yaml" in said and "Traceback" not in said
    assert f"VULNERABLE {STACK}.x86_64.txt" in r.stdout and f"audited {STACK}.aarch64.txt" in r.stdout
    assert tree(vulnerable) == before
    assert {q["package"]["name"] for q in osv.queries} >= {"pycrypto", "torch", "deepspeed"}


def test_an_allowlist_entry_lets_it_pass_and_an_expired_one_does_not(vulnerable, osv):
    _allow(vulnerable, entry("PYSEC-2017-94", "2099-12-31"), entry("CVE-2018-6594", "2099-12-31"))
    r = run_here("audit", "--stack", STACK, "--matrix-dir", str(vulnerable), "--vulnerability-service", osv.url)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "allowed PYSEC-2017-94 in pycrypto 2.6.1 until 2099-12-31: only Crypto.Hash" in r.stdout
    assert "allowed PYSEC-2018-97" in r.stdout  # allowed by its alias
    _allow(vulnerable, entry("PYSEC-2017-94", "2099-12-31"), entry("PYSEC-2018-97", "2020-01-31"))
    r = run_here("audit", "--stack", STACK, "--matrix-dir", str(vulnerable), "--vulnerability-service", osv.url)
    assert r.returncode == 1
    assert "PYSEC-2018-97" in r.stderr and "the allowlist entry expired on 2020-01-31" in " ".join(r.stderr.split())
    assert "PYSEC-2017-94 (" not in r.stderr  # the live entry still allows that one


def test_an_entry_for_another_package_does_not_allow_the_advisory(vulnerable, osv):
    _allow(vulnerable, entry("PYSEC-2017-94", "2099-12-31", package="pycryptodome"),
           entry("PYSEC-2018-97", "2099-12-31"))
    r = run_here("audit", "--stack", STACK, "--matrix-dir", str(vulnerable), "--vulnerability-service", osv.url)
    assert r.returncode == 1 and "PYSEC-2017-94" in r.stderr


@pytest.mark.parametrize("text, said", [
    ("allow:\n  - id: PYSEC-2017-94\n    reason: r\n", "at allow.0.expires: Field required"),
    ("allow:\n  - id: pysec 2017\n    reason: r\n    expires: 2099-01-01\n", "is not an advisory id"),
    ("allow:\n  - id: PYSEC-2017-94\n    reason: ' '\n    expires: 2099-01-01\n", "the reason is empty"),
    ("allow:\n  - id: PYSEC-2017-94\n    reason: r\n    expires: next year\n", "at allow.0.expires"),
    ("allow:\n  - id: PYSEC-2017-94\n    reason: r\n    expires: 2099-01-01\n    until: x\n", "allow.0.until"),
    ("allow: [\n", "is not valid YAML"),
    ("ignore: [PYSEC-2017-94]\n", "at ignore"),
])
def test_a_malformed_allowlist_is_refused_with_exit_2_naming_the_entry(vulnerable, osv, text, said):
    (vulnerable / "vulnerabilities.yaml").write_text(text)
    r = run_here("audit", "--stack", STACK, "--matrix-dir", str(vulnerable), "--vulnerability-service", osv.url)
    assert r.returncode == 2, r.stdout + r.stderr
    assert said in r.stderr and "vulnerabilities.yaml" in r.stderr and "Traceback" not in r.stderr
    assert "expires: 2027-03-31" in r.stderr  # the example of a valid entry


def test_an_unknown_service_and_stack_are_refused(vulnerable):
    r = run_here("audit", "--matrix-dir", str(vulnerable), "--vulnerability-service", "osv.dev")
    assert r.returncode == 2 and "is not pypi" in r.stderr and "/v1/query" in r.stderr
    r = run_here("audit", "--stack", "torch2.11-cu130-py3.13", "--matrix-dir", str(vulnerable))
    assert r.returncode == 2 and f"nearest: {STACK}" in r.stderr


def test_packages_the_service_cannot_answer_for_close_the_gate(vulnerable):
    """A service that answers nothing (here: a port where nothing listens) is not a pass."""
    r = run_here("audit", "--stack", STACK, "--matrix-dir", str(vulnerable), "--vulnerability-service",
                "http://127.0.0.1:9/v1/query", timeout=300)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "could not audit" in r.stderr or "could not be audited" in r.stderr, r.stderr


def test_the_gate_sorts_findings_by_the_entries_in_force():
    from envbuild.supply.audit import Allowance, Finding, gate

    f = Finding("pycrypto", "2.6.1", ("PYSEC-2017-94", "CVE-2013-7459"), (), "", "x")
    today = dt.date(2026, 11, 26)
    live = Allowance(id="CVE-2013-7459", reason="r", expires=today)  # expires today: still in force
    old = Allowance(id="PYSEC-2017-94", reason="r", expires=today - dt.timedelta(days=1))
    assert gate([f], [], [live], today).ok and not gate([f], [], [old], today).ok
    assert gate([f], [], [old], today).blocked[0][1] is old
    assert not gate([], [], [], today).blocked and gate([], [], [], today).ok


def test_a_local_version_is_looked_up_as_its_public_one():
    from envbuild.supply.audit import public_pins

    pins, notes = public_pins({"torch": "2.4.0+cu121", "Six": "1.17.0"})
    assert pins == {"torch": "2.4.0", "six": "1.17.0"} and notes == ["torch 2.4.0+cu121 looked up as 2.4.0"]


@pytest.mark.parametrize("where", ["answers", "does not answer"])
def test_a_service_url_s_credentials_reach_no_message_or_output(vulnerable, osv, where):
    """--vulnerability-service https://user:token@host/...: the token is the user's secret; it
    is used for the query and shown nowhere (messages, tables, JSON)."""
    token = "s3cr3t-t0ken-4f9a"
    url = osv.url if where == "answers" else "http://127.0.0.1:9/v1/query"
    url = url.replace("http://", f"http://ci:{token}@", 1)
    for json_flag in ((), ("--json",)):
        r = run_here("audit", "--stack", STACK, "--matrix-dir", str(vulnerable), "--vulnerability-service", url,
                     *json_flag, timeout=300)
        assert r.returncode == 1, r.stdout + r.stderr
        assert token not in r.stdout + r.stderr and "***@127.0.0.1" in r.stdout + r.stderr
