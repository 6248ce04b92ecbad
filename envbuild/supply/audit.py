"""The vulnerability gate: every pinned Python distribution (a stack's lock, or what an image
really holds) is looked up by pip-audit in PyPI's vulnerability data (the Python Packaging
Advisory Database, through PyPI's JSON API), or in an OSV service; a finding stops the publish
unless the matrix's allowlist (matrices/vulnerabilities.yaml) names the advisory with a reason
and a date it expires on.

pip-audit runs as its command line (``python -m pip_audit``, its documented interface; its
Python modules are private), on a requirements file of ``NAME==VERSION`` lines, with
``--no-deps --disable-pip``: the pins are already complete, nothing is resolved or installed.

A package the service cannot answer for (pip-audit's "skip_reason": not on the index, the
service unreachable) is not a pass: the result says so and the gate is closed. A gate that
cannot see is not a gate.

OS packages (dpkg) are not scanned here: the SBOM lists them (:mod:`envbuild.supply.sbom`) for a
scanner that reads CycloneDX.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from envbuild.base import grammar
from envbuild.base.errors import EnvbuildError, nearest
from envbuild.base.files import read_text, read_yaml
from envbuild.base.grammar import redact
from envbuild.knowledge.lock import LOCK_DIR, Lock, parse_lock
from envbuild.knowledge.matrix import ALLOWLIST

SERVICE_ENV = "ENVBUILD_VULNERABILITY_SERVICE"
SERVICES = ("pypi", "osv")  # pip-audit's names: PyPI's JSON API (the default), api.osv.dev
# Advisory ids as the databases write them: PYSEC-2017-94, GHSA-cq27-v7xp-c356, CVE-2013-7459,
# and OSV's other prefixes (PREFIX-...), upper-case letters, digits and '-'.
ADVISORY_ID = re.compile(r"^(GHSA(-[23456789cfghjmpqrvwx]{4}){3}|[A-Z][A-Z0-9]*(-[A-Za-z0-9._]+)+)\Z")
PIP_AUDIT_TIMEOUT = 900  # seconds for one pip-audit run (a lock of 50 packages: about 5 s)


# ---------------------------------------------------------------- the allowlist


class Allowance(BaseModel):
    """One accepted advisory: which, for which package (all, if none), why, and until when."""

    model_config = ConfigDict(extra="forbid")
    id: str
    package: Optional[str] = None
    reason: str = Field(min_length=1)
    expires: dt.date

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        if not ADVISORY_ID.match(value):
            raise ValueError(f"'{value}' is not an advisory id such as PYSEC-2017-94, GHSA-cq27-v7xp-c356 or "
                             f"CVE-2013-7459")
        return value

    @field_validator("reason")
    @classmethod
    def _reason(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the reason is empty; say why the advisory does not apply to these images")
        return value

    def covers(self, finding: "Finding") -> bool:
        return (self.id in finding.ids
                and (self.package is None or canonicalize_name(self.package) == canonicalize_name(finding.package)))


class AllowFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    allow: list[Allowance] = []


EXAMPLE = ("allow:\n  - id: PYSEC-2017-94\n    package: pycrypto\n    reason: \"only Crypto.Hash is imported; "
           "the ALGnew overflow is in the block ciphers\"\n    expires: 2027-03-31")


def load_allowlist(matrix_dir: Path) -> list[Allowance]:
    """The matrix's allowlist (none without the file), each entry checked: a malformed one is
    refused with its place in the file, never ignored."""
    path = Path(matrix_dir) / ALLOWLIST
    if not os.path.lexists(path):  # a FIFO or a device there is refused below, not read as "no allowlist"
        return []
    try:
        data = read_yaml(path, "vulnerability allowlist")  # regular, bounded, UTF-8, bounded YAML
    except EnvbuildError as e:
        raise EnvbuildError(f"{e.message} It holds a list `allow` of entries such as:\n{EXAMPLE}") from None
    try:
        return AllowFile.model_validate(data if data is not None else {}).allow
    except ValidationError as e:
        problems = []
        for error in e.errors()[:3]:
            where = ".".join(str(x) for x in error["loc"]) or "(top level)"
            problems.append(f"at {where}: {error['msg'].removeprefix('Value error, ')}")
        raise EnvbuildError(f"vulnerability allowlist {path} is malformed {'; '.join(problems)}. Each entry names "
                            f"the advisory (id), optionally its package, the reason and the date it expires "
                            f"(YYYY-MM-DD), e.g.:\n{EXAMPLE}") from None


# ---------------------------------------------------------------- running pip-audit


def service_from(value: Optional[str]) -> str:
    """--vulnerability-service (or $ENVBUILD_VULNERABILITY_SERVICE): pypi (default), osv, or the
    URL of an OSV-compatible query endpoint (a mirror of api.osv.dev/v1/query)."""
    value = (value or os.environ.get(SERVICE_ENV) or "pypi").strip()
    if value in SERVICES or re.match(r"^https?://[^\s/]+(/\S*)?\Z", value):
        return value
    raise EnvbuildError(f"--vulnerability-service {grammar.shown(value)} is not pypi (PyPI's vulnerability data, the default), "
                        f"osv (api.osv.dev) or the http(s) URL of an OSV-compatible query endpoint, such as "
                        f"https://osv-mirror.example/v1/query.")


def _service_args(service: str) -> list[str]:
    if service in SERVICES:
        return ["-s", service]
    return ["-s", "osv", "--osv-url", service]


@dataclass(frozen=True)
class Finding:
    package: str
    version: str
    ids: tuple[str, ...]  # the advisory's id first, then its aliases
    fix_versions: tuple[str, ...]
    description: str
    where: str  # the lock section or image the pin came from

    @property
    def id(self) -> str:
        return self.ids[0]


@dataclass(frozen=True)
class Unaudited:
    package: str
    version: str
    reason: str
    where: str


def public_pins(pins: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Pins as the vulnerability data knows them: a local version label (torch 2.4.0+cu121 from
    PyTorch's index) is looked up as its public version, and said so."""
    out, notes = {}, []
    for name, version in sorted(pins.items()):
        try:
            public = Version(version).public
        except InvalidVersion:
            public = version
        if public != version:
            notes.append(f"{name} {version} looked up as {public}")
        out[canonicalize_name(name)] = public
    return out, notes


def run_pip_audit(pins: dict[str, str], where: str, service: str,
                  cache_dir: Optional[Path] = None) -> tuple[list[Finding], list[Unaudited]]:
    """Every advisory pip-audit finds for `pins` (name -> version), and what it could not look up."""
    if not pins:
        return [], []
    with tempfile.TemporaryDirectory(prefix="envbuild-audit-") as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items())))
        argv = [sys.executable, "-m", "pip_audit", "-r", str(requirements), "--no-deps", "--disable-pip",
                "--progress-spinner", "off", "-f", "json", "--timeout", "30", *_service_args(service),
                *(["--cache-dir", str(cache_dir)] if cache_dir else [])]
        try:
            run = subprocess.run(argv, capture_output=True, text=True, timeout=PIP_AUDIT_TIMEOUT,
                                 env={**os.environ, "PIP_AUDIT_PROGRESS_SPINNER": "off"})
        except subprocess.TimeoutExpired:
            raise EnvbuildError(f"pip-audit of {where} did not finish in {PIP_AUDIT_TIMEOUT} s (service {service}); "
                                f"nothing was audited.", exit_code=1) from None
    try:
        report = json.loads(run.stdout)
        dependencies = report["dependencies"]
    except (ValueError, KeyError, TypeError):
        said = [line for line in run.stderr.splitlines() if line.strip()]
        raise EnvbuildError(f"pip-audit could not audit {where} against {service} (exit {run.returncode}): "
                            f"{said[-1][:400] if said else 'no output'}. Nothing was audited.", exit_code=1) from None
    findings, unaudited = [], []
    for dep in dependencies:
        if dep.get("skip_reason"):
            unaudited.append(Unaudited(dep["name"], dep.get("version") or pins.get(dep["name"], "?"),
                                       dep["skip_reason"], where))
            continue
        for vuln in dep.get("vulns") or []:
            findings.append(Finding(dep["name"], dep["version"], (vuln["id"], *sorted(vuln.get("aliases", []))),
                                    tuple(vuln.get("fix_versions") or ()), " ".join((vuln.get("description") or
                                                                                     "").split())[:300], where))
    return findings, unaudited


# ---------------------------------------------------------------- the gate


@dataclass
class AuditResult:
    findings: list[Finding] = field(default_factory=list)
    unaudited: list[Unaudited] = field(default_factory=list)
    allowed: list[tuple[Finding, Allowance]] = field(default_factory=list)
    blocked: list[tuple[Finding, Optional[Allowance]]] = field(default_factory=list)  # with an expired entry
    audited: int = 0  # distributions looked up
    notes: list[str] = field(default_factory=list)
    service: str = "pypi"

    @property
    def ok(self) -> bool:
        return not self.blocked and not self.unaudited

    def summary(self) -> str:
        """One line: what was looked up and what came of it."""
        return (f"{self.audited} distributions looked up in {redact(self.service)}: {len(self.findings)} advisories, "
                f"{len(self.allowed)} allowed, {len(self.blocked)} not allowed, {len(self.unaudited)} not audited")

    def refusal(self, what: str) -> str:
        """The one paragraph that stops a publish (or fails a check)."""
        parts = []
        for finding, expired in self.blocked:
            fix = f", fixed in {', '.join(finding.fix_versions)}" if finding.fix_versions else ", no fixed release"
            why = (f" (the allowlist entry expired on {expired.expires.isoformat()})" if expired else "")
            parts.append(f"{finding.id} ({', '.join(finding.ids[1:]) or 'no alias'}) in {finding.package} "
                         f"{finding.version}{fix}{why}")
        if self.blocked:
            text = (f"{what} has {len(self.blocked)} known vulnerabilit{'y' if len(self.blocked) == 1 else 'ies'} "
                    f"not allowed: {'; '.join(parts)}. Move the pin to a fixed release (envbuild lock --upgrade), "
                    f"or accept the advisory for a time in matrices/{ALLOWLIST} with its id, the reason and an "
                    f"expiry date.")
        else:
            text = ""
        if self.unaudited:
            names = ", ".join(f"{u.package} {u.version}" for u in self.unaudited[:5])
            more = f" and {len(self.unaudited) - 5} more" if len(self.unaudited) > 5 else ""
            text += ((" " if text else "") + f"{what}: {len(self.unaudited)} distributions could not be audited "
                     f"({names}{more}): {self.unaudited[0].reason}. The vulnerability service ({self.service}) "
                     f"did not answer for them, so the gate stays closed; point --vulnerability-service (or "
                     f"${SERVICE_ENV}) at one that answers, such as an OSV mirror's /v1/query URL.")
        return redact(text)  # a service's reason may quote its URL, token and all


def gate(findings: list[Finding], unaudited: list[Unaudited], allowlist: list[Allowance],
         today: Optional[dt.date] = None) -> AuditResult:
    """Sort findings into allowed (a live entry names them) and blocked (none does, or it expired)."""
    today = today or dt.datetime.now(dt.timezone.utc).date()
    result = AuditResult(findings=list(findings), unaudited=list(unaudited))
    for finding in findings:
        entries = [a for a in allowlist if a.covers(finding)]
        live = [a for a in entries if a.expires >= today]
        if live:
            result.allowed.append((finding, live[0]))
        else:
            result.blocked.append((finding, max(entries, key=lambda a: a.expires) if entries else None))
    return result


def audit_pins(pins: dict[str, str], where: str, service: str, allowlist: list[Allowance],
               today: Optional[dt.date] = None) -> AuditResult:
    """pip-audit `pins`, then the allowlist."""
    public, notes = public_pins(pins)
    findings, unaudited = run_pip_audit(public, where, service)
    result = gate(findings, unaudited, allowlist, today)
    result.audited, result.notes, result.service = len(public), notes, redact(service)
    return result


def audit_lock(lock: Lock, service: str, allowlist: list[Allowance], today: Optional[dt.date] = None,
               progress: Callable[[str], None] = lambda _: None) -> AuditResult:
    """Every section of a lock (the venv, and the PyPI toolchain where there is one)."""
    total = AuditResult(service=service)
    for section in sorted(lock.sections):
        where = f"{Path(lock.path).name} [{section}]"
        progress(f"auditing {where}")
        part = audit_pins(lock.pins(section), where, service, allowlist, today)
        for name in ("findings", "unaudited", "allowed", "blocked", "notes"):
            getattr(total, name).extend(getattr(part, name))
        total.audited += part.audited
    return total


def audit_locks(matrix_dir: Path, stack_ids: tuple[str, ...], known: set[str], service: Optional[str]
                ) -> list[tuple[str, AuditResult]]:
    """Every lock of the matrix (of `stack_ids` where given), audited: (lock file name, result)."""
    for s in stack_ids:
        if s not in known:
            raise EnvbuildError(f"--stack {s}: no such stack; nearest: {', '.join(nearest(s, known)) or 'none'}.")
    service = service_from(service)
    allowlist = load_allowlist(matrix_dir)
    paths = sorted((Path(matrix_dir) / LOCK_DIR).glob("*.txt"))
    return [(p.name, audit_lock(parse_lock(read_text(p, "lock file", "matrix"), str(p)), service, allowlist))
            for p in paths if not stack_ids or p.name.rsplit(".", 2)[0] in stack_ids]
