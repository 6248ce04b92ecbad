"""Run an image's built-in smoke test (/opt/envbuild/smoke.py) in a container and record
the verdict, so `envbuild push` can refuse an image that has not passed. The container runs
through the engine interface (:mod:`envbuild.engine`).

The record is a JSON file named after the image ID (the sha256 of its config), in
``$ENVBUILD_STATE_DIR`` (default ``~/.local/state/envbuild``)/smoke/. An image ID cannot
change without the image changing, so a record can never vouch for different bits.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from envbuild.base.emulation import QEMU_CPU, QEMU_CPU_SYSFS, qemu_cpu_stub
from envbuild.base.errors import EnvbuildError
from envbuild.base.files import read_bytes, write_atomic
from envbuild.engine import Engine, get_engine
from envbuild.image import paths as image_paths
from envbuild.image.report import status_word

SMOKE = image_paths.SMOKE
PYTHON = image_paths.VENV_PYTHON
# Under qemu-user every check runs 10-20x slower than natively (importing torch alone takes
# about 15 s): the in-image per-check limit (smoke.py --timeout, 120 s) grows to this.
QEMU_CHECK_TIMEOUT = 1800


@dataclass
class SmokeReport:
    image: str
    image_id: str
    ok: bool
    mode: str
    checks: list[dict]
    seconds: float
    raw: dict


def state_dir() -> Path:
    base = os.environ.get("ENVBUILD_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "envbuild")
    return Path(base)


def record_path(image_id: str) -> Path:
    return state_dir() / "smoke" / (image_id.split(":", 1)[-1] + ".json")


def run_smoke(image: str, gpus: Optional[str] = None, timeout: int = 900,
              env: Optional[dict] = None, record: bool = True, engine: Optional[Engine] = None,
              qemu: bool = False) -> SmokeReport:
    """Run the smoke test of `image`; record the verdict under its image ID.

    Parameters
    ----------
    gpus:
        ``all`` or a count, as ``docker run --gpus``; None runs the CPU checks only.
    timeout:
        Seconds before the container is killed and the run counts as hung.
    engine:
        The container engine (default: :func:`envbuild.engine.get_engine`).
    qemu:
        An arm64 image on an x86-64 machine, under qemu-user: bind the stub CPU sysfs torch needs
        there (templates/files/qemu) and emulate a CPU with Grace's 128-bit SVE (emulation.QEMU_CPU).
        The record says so.
    """
    engine = engine or get_engine()
    info = engine.inspect(image)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="envbuild-qemu-") as stub:
        mounts = None
        if qemu:
            shutil.copytree(qemu_cpu_stub(), Path(stub) / "cpu")
            mounts = {str(Path(stub) / "cpu"): QEMU_CPU_SYSFS[1]}
            env = {"QEMU_CPU": QEMU_CPU, **(env or {})}
        # By image ID, not by name: the verdict is recorded for exactly the bits that ran.
        argv = [PYTHON, SMOKE, "--json", *(["--timeout", str(QEMU_CHECK_TIMEOUT)] if qemu else [])]
        # On a GPU node with RDMA devices the transport check opens them, as a multi-node job would.
        rdma = {"rdma": True} if gpus and os.path.isdir(image_paths.RDMA_DEVICES) else {}
        run = engine.run(info.id, argv, timeout=timeout, gpus=gpus, network="none",
                         env=env or {}, entrypoint=[image_paths.ENTRYPOINT], **({"mounts": mounts} if mounts else {}),
                         **rdma)
    if run.timed_out:
        raise EnvbuildError(f"smoke test of {image} did not finish in {timeout} s; the container was "
                            f"killed. Re-run with a larger --timeout, or look for a hang.", exit_code=1)
    seconds = time.monotonic() - start
    try:
        raw = _last_json(run.stdout)
    except ValueError:
        raise EnvbuildError(f"smoke test of {image} printed no result (exit {run.exit_code}); "
                            f"is {SMOKE} in the image? Last output: "
                            f"{(run.stderr or run.stdout).strip()[-800:]}", exit_code=1) from None
    rep = SmokeReport(image, info.id, bool(raw.get("ok")) and run.exit_code == 0,
                      raw.get("mode", "?"), raw.get("checks", []), seconds, raw)
    if record:
        p = record_path(info.id)
        p.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(p, json.dumps({"image": image, "image_id": info.id, "platform": info.platform,
                                 **({"emulated": "qemu-user", "qemu_cpu": QEMU_CPU} if qemu else {}),
                                 "ok": rep.ok, "mode": rep.mode,
                                 "checked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                 "checks": rep.checks}, indent=2).encode())
    return rep


def table_rows(report: SmokeReport) -> list[tuple[str, str, str, str]]:
    """(check, result, time, detail) per check, as `envbuild smoke` prints them; result is ok, FAIL
    or skip (a check that does not apply here: CPU mode, a single GPU)."""
    return [(str(c.get("name")), status_word(c), f"{c.get('seconds', 0):.1f}s", str(c.get("detail", "")))
            for c in report.checks]


def _last_json(text: str) -> dict:
    """The last JSON object in `text` (the smoke test prints one, possibly indented)."""
    starts = [0] if text.startswith("{") else []
    starts += [i + 1 for i in range(len(text)) if text.startswith("\n{", i)]
    for start in reversed(starts):
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[start:])
            if isinstance(obj, dict):
                return obj
        except json.JSONDecodeError:
            continue
    raise ValueError("no JSON object")


def require_passed(image_id: str, image: str, platform: Optional[str] = None) -> dict:
    """The smoke record of `image_id`, or an error saying why it may not be published.

    With `platform` (an entry of a manifest list), the record must be of an image of that
    platform: the list must not send arm64 nodes to an image tested as another one.
    """
    p = record_path(image_id)
    if not p.is_file():
        raise EnvbuildError(f"refusing to push {image}: no smoke test has been recorded for image "
                            f"{image_id[:19]}; run `envbuild smoke {image}` first.", exit_code=1)
    try:
        rec = json.loads(read_bytes(p, "smoke record", "record"))
        if not isinstance(rec, dict):
            raise ValueError("not an object")
    except ValueError:
        raise EnvbuildError(f"refusing to push {image}: its smoke record {p} is damaged (not the JSON envbuild "
                            f"writes); run `envbuild smoke {image}` again.", exit_code=1) from None
    if not rec.get("ok"):
        failed = [c["name"] for c in rec.get("checks", []) if not c.get("ok")]
        raise EnvbuildError(f"refusing to push {image}: its smoke test failed ({', '.join(failed) or 'see record'}; "
                            f"record {p}). Fix the image and run `envbuild smoke` again.", exit_code=1)
    recorded = rec.get("platform")
    if platform and recorded and recorded != platform:
        raise EnvbuildError(f"refusing to publish {image}: the manifest list names it {platform}, but the image "
                            f"its smoke test ran ({image_id[:19]}) is {recorded} (record {p}).", exit_code=1)
    return rec
