"""Run an image's built-in smoke test (/opt/envbuild/smoke.py) in a container and record
the verdict, so `envbuild push` can refuse an image that has not passed.

The record is a JSON file named after the image ID (the sha256 of its config), in
``$ENVBUILD_STATE_DIR`` (default ``~/.local/state/envbuild``)/smoke/. An image ID cannot
change without the image changing, so a record can never vouch for different bits.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import EnvbuildError

SMOKE = "/opt/envbuild/smoke.py"
PYTHON = "/opt/venv/bin/python"


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


def docker_client():
    import docker
    from docker.errors import DockerException

    try:
        client = docker.from_env(timeout=600)
        client.ping()
        return client
    except DockerException as e:
        raise EnvbuildError(f"cannot reach the Docker engine ({e}); start dockerd "
                            f"(scripts/host-setup.sh does) or set DOCKER_HOST.") from None


def get_image(client, image: str):
    from docker.errors import ImageNotFound

    try:
        return client.images.get(image)
    except ImageNotFound:
        raise EnvbuildError(f"image '{image}' does not exist locally; build it with `envbuild build` "
                            f"or pull it first.") from None


def run_smoke(image: str, gpus: Optional[str] = None, timeout: int = 900,
              env: Optional[dict] = None, record: bool = True) -> SmokeReport:
    """Run the smoke test of `image`; record the verdict under its image ID.

    Parameters
    ----------
    gpus:
        ``all`` or a count, as ``docker run --gpus``; None runs the CPU checks only.
    timeout:
        Seconds before the container is killed and the run counts as hung.
    """
    from docker.types import DeviceRequest

    client = docker_client()
    img = get_image(client, image)
    kwargs = dict(network_mode="none", shm_size="1g", detach=True, environment=env or {},
                  entrypoint=["/opt/envbuild/entrypoint.sh"])
    if gpus:
        count = -1 if gpus == "all" else int(gpus)
        kwargs["device_requests"] = [DeviceRequest(count=count, capabilities=[["gpu"]])]
    start = time.monotonic()
    container = client.containers.run(img.id, [PYTHON, SMOKE, "--json"], **kwargs)
    try:
        try:
            status = container.wait(timeout=timeout)
        except Exception:
            container.kill()
            raise EnvbuildError(f"smoke test of {image} did not finish in {timeout} s; the container was "
                                f"killed. Re-run with a larger --timeout, or look for a hang.", exit_code=1)
        stdout = container.logs(stdout=True, stderr=False).decode(errors="replace")
        stderr = container.logs(stdout=False, stderr=True).decode(errors="replace")
    finally:
        container.remove(force=True)
    seconds = time.monotonic() - start
    try:
        raw = _last_json(stdout)
    except ValueError:
        raise EnvbuildError(f"smoke test of {image} printed no result (exit {status.get('StatusCode')}); "
                            f"is /opt/envbuild/smoke.py in the image? Last output: "
                            f"{(stderr or stdout).strip()[-800:]}", exit_code=1) from None
    rep = SmokeReport(image, img.id, bool(raw.get("ok")) and status.get("StatusCode") == 0,
                      raw.get("mode", "?"), raw.get("checks", []), seconds, raw)
    if record:
        p = record_path(img.id)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({"image": image, "image_id": img.id, "ok": rep.ok, "mode": rep.mode,
                                 "checked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                 "checks": rep.checks}, indent=2))
    return rep


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


def require_passed(image_id: str, image: str) -> dict:
    """The smoke record of `image_id`, or an error saying why it may not be published."""
    p = record_path(image_id)
    if not p.is_file():
        raise EnvbuildError(f"refusing to push {image}: no smoke test has been recorded for image "
                            f"{image_id[:19]}; run `envbuild smoke {image}` first.", exit_code=1)
    rec = json.loads(p.read_text())
    if not rec.get("ok"):
        failed = [c["name"] for c in rec.get("checks", []) if not c.get("ok")]
        raise EnvbuildError(f"refusing to push {image}: its smoke test failed ({', '.join(failed) or 'see record'}; "
                            f"record {p}). Fix the image and run `envbuild smoke` again.", exit_code=1)
    return rec
