"""`envbuild lock`: the stacks' locks, Python (uv) and, with --os, OS packages (apt in the base);
`envbuild audit`: the vulnerability gate on them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from envbuild.base.errors import EnvbuildError
from envbuild.cli.app import err, main, out
from envbuild.cli.options import SERVICE, matrix_dir_option


@main.command()
@click.option("--stack", "stack_ids", multiple=True, metavar="ID", help="Lock this stack (repeatable); default: every stack.")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if a lock is missing or resolving again gives another file.")
@click.option("--upgrade", is_flag=True, help="Resolve as of today instead of the lock's own date (newer packages).")
@click.option("--bases", is_flag=True,
              help="Also record the digest each stack's base image has on its registry (matrices/base-digests.yaml; "
                   "renders then pin FROM to it). For the publishing CI: Docker Hub must be reachable.")
@click.option("--os", "os_packages", is_flag=True,
              help="Lock the OS packages instead (matrices/locks/os): apt's solver in a throwaway container of each "
                   "stage's base image, every package with its version and .deb sha256. Needs Docker and the bases.")
@click.option("--base-image", metavar="REF", help="With --os and one --stack: resolve on this base image instead "
                                                  "of the stack's (a lab's own base).")
@click.option("--apt-snapshot", metavar="URL", help="With --os: where to resolve from, instead of the snapshot service "
                                                    "at this moment: a URL with {archive} (and {timestamp}) in it, or "
                                                    "'live' for the live archive.")
@SERVICE
@matrix_dir_option
def lock(stack_ids, check, upgrade, bases, os_packages, base_image, apt_snapshot, service, matrix_dir):
    """Hash-lock stacks: every Python distribution each image installs, == with its sha256
    hashes, resolved by uv for the image's Python, CPU and glibc into matrices/locks/; with
    --os, every OS package, by version and .deb sha256, into matrices/locks/os/.

    A lock keeps its date (uv --exclude-newer) while it agrees with its stack row, so running
    this again gives the same file; --upgrade moves the date to today. An OS lock records the
    moment of the archive it was resolved from; --check resolves it again at that moment."""
    from envbuild.resolve.locking import lock_stacks, lock_summary
    from envbuild.knowledge.matrix import load_matrix
    from envbuild.supply.audit import service_from

    service_from(service)  # before the resolve, which takes minutes: a typo is refused at once
    m = load_matrix(Path(matrix_dir) if matrix_dir else None)
    if os_packages or base_image or apt_snapshot:
        _lock_os(m, stack_ids, check, os_packages, base_image, apt_snapshot)
        return
    if bases and not check:
        _record_bases(m, stack_ids)
    outcomes = lock_stacks(m, tuple(stack_ids), check=check, upgrade=upgrade,
                           progress=lambda text: err.print(f"envbuild: {text}", markup=False))
    _print_outcomes(outcomes)
    problems = lock_summary(outcomes, check)
    if problems:
        err.print("\n".join(f"envbuild: {p}" for p in problems), markup=False, soft_wrap=True)
    # --check audits too (as `envbuild audit`): a current lock with a known vulnerability is not a good lock
    if problems or (check and not all(r.ok for _, r in print_audit(m, stack_ids, service))):
        sys.exit(1)


def _print_outcomes(outcomes) -> None:
    for o in outcomes:
        line = f"{o.state:<9} {o.stack}  {o.path}" + (f"\n          {o.detail}" if o.detail else "")
        out.print(line, markup=False, soft_wrap=True)


def _lock_os(m, stack_ids, check, os_packages, base_image, apt_snapshot) -> None:
    """lock --os: the OS locks of the chosen stacks (resolved by apt in their base images)."""
    from envbuild.engine import get_engine
    from envbuild.knowledge.oslock import check_snapshot_template
    from envbuild.knowledge.rules import PLATFORMS
    from envbuild.oci.registry import check_image_reference
    from envbuild.resolve.locking import lock_summary
    from envbuild.resolve.oslocking import lock_os_stacks

    if not os_packages:
        raise EnvbuildError(f"{'--base-image' if base_image else '--apt-snapshot'} applies to OS locks only: add --os.")
    check_snapshot_template("--apt-snapshot", apt_snapshot, live_ok=True)
    check_image_reference("--base-image", base_image)
    engine = get_engine()
    # no daemon: exit 2 (an unusable environment) here; inside the resolve its "cannot reach" read as an
    # unreachable archive (exit 1, "run it where the registries are reachable")
    engine.check_usable()
    outcomes = lock_os_stacks(engine, m, tuple(stack_ids), base_image, apt_snapshot, check=check,
                              platforms=PLATFORMS, progress=lambda text: err.print(f"envbuild: {text}", markup=False))
    _print_outcomes(outcomes)
    problems = lock_summary(outcomes, check, "envbuild lock --os")
    if problems:
        err.print("\n".join(f"envbuild: {p}" for p in problems), markup=False, soft_wrap=True)
        sys.exit(1)


def _record_bases(m, stack_ids) -> None:
    """lock --bases: the digest each chosen stack's base images have on their registries."""
    from envbuild.builds.digests import record_base_digests
    from envbuild.resolve.locking import today

    refs = [ref for s in m.stacks if not stack_ids or s.id in stack_ids
            for ref in (s.base_images.builder, s.base_images.runtime)]
    recorded, unreachable = record_base_digests(m.directory, refs, today()[:10])
    for ref in sorted(set(refs)):
        state = "unreachable (kept what was recorded)" if ref in unreachable else recorded.get(ref, "")
        out.print(f"base      {ref}  {state}", markup=False, soft_wrap=True)


@main.command()
@click.option("--stack", "stack_ids", multiple=True, metavar="ID", help="Audit this stack's locks (repeatable); "
                                                                       "default: every lock.")
@SERVICE
@click.option("--json", "as_json", is_flag=True, help="Print every finding as JSON.")
@matrix_dir_option
def audit(stack_ids, service, as_json, matrix_dir):
    """Look up every pin of the matrix's locks (matrices/locks/*.txt) in PyPI's vulnerability
    data with pip-audit; a finding fails (exit 1) unless matrices/vulnerabilities.yaml allows
    it, with a reason, until a date. `envbuild lock --check` runs this too."""
    from envbuild.knowledge.matrix import load_matrix

    m = load_matrix(Path(matrix_dir) if matrix_dir else None)
    results = print_audit(m, stack_ids, service, show=not as_json)
    if as_json:
        click.echo(json.dumps([{"lock": where, "ok": r.ok, "summary": r.summary(),
                                "blocked": [f.id for f, _ in r.blocked], "allowed": [f.id for f, _ in r.allowed],
                                "unaudited": [f"{u.package}=={u.version}" for u in r.unaudited]}
                               for where, r in results], indent=2))
    if not all(r.ok for _, r in results):
        sys.exit(1)


def print_audit(m, stack_ids, service, show=True) -> list:
    """Audit the locks (of `stack_ids`, or all), print one line per lock and the allowed findings."""
    from envbuild.supply.audit import audit_locks

    results = audit_locks(m.directory, tuple(stack_ids), {s.id for s in m.stacks}, service)
    for name, r in results:
        if show:
            out.print(f"{'audited' if r.ok else 'VULNERABLE' if r.blocked else 'unaudited'} {name}: {r.summary()}",
                      markup=False, soft_wrap=True)
            for f, a in r.allowed:
                out.print(f"  allowed {f.id} in {f.package} {f.version} until {a.expires}: {a.reason}", markup=False,
                          soft_wrap=True)
        if not r.ok:
            err.print(f"envbuild: {r.refusal(name)}", markup=False, soft_wrap=True)
    return results
