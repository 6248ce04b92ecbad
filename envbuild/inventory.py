"""What an image holds, read inside it: the Python distributions its venv's Python sees
(importlib.metadata), the OS packages dpkg installed (/var/lib/dpkg/status), the OS release, and
the records envbuild copied in (manifest, lock, extension build record). Printed as one JSON
object.

Standard library only, Python >= 3.8, no import of envbuild: the host runs this file's source in
the image (``python -I -c SOURCE``, no network), so any image can be read, including one built by
another envbuild version. The SBOM is made from this output (:mod:`envbuild.sbom`), and
`envbuild verify` compares an SBOM with it.
"""

import json
import os
import sys
from importlib import metadata

OPT = "/opt/envbuild"
RECORDS = {"manifest": OPT + "/manifest.json", "lock": OPT + "/lock.txt", "extend_lock": OPT + "/extend-lock.txt",
           "extensions": OPT + "/built/extensions.json"}
DPKG_STATUS = "/var/lib/dpkg/status"
RECORD_LIMIT = 16 << 20


def dpkg_packages(path=DPKG_STATUS):
    """Installed packages of a dpkg status file: package, version, architecture, source."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    out = []
    for para in text.split("\n\n"):
        fields, key = {}, None
        for line in para.splitlines():
            if line[:1] in (" ", "\t") and key:
                continue  # a continuation line (Description, Conffiles)
            key, sep, value = line.partition(":")
            if sep:
                fields[key] = value.strip()
        if fields.get("Package") and fields.get("Status", "").endswith(" installed"):
            source = fields.get("Source", fields["Package"]).split(" ")[0]
            out.append({"package": fields["Package"], "version": fields.get("Version", ""),
                        "architecture": fields.get("Architecture", ""), "source": source})
    return sorted(out, key=lambda p: (p["package"], p["architecture"]))


def python_distributions():
    """Every distribution this Python sees: name, version, where it lives."""
    out = []
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if not name:
            continue
        location = str(getattr(dist, "_path", "") or "")
        out.append({"name": name, "version": dist.version, "location": os.path.dirname(location)})
    return sorted(out, key=lambda d: (d["name"].lower(), d["version"], d["location"]))


def os_release(path="/etc/os-release"):
    fields = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.strip().partition("=")
                if sep:
                    fields[key] = value.strip().strip('"')
    except OSError:
        pass
    return {"id": fields.get("ID", ""), "version_id": fields.get("VERSION_ID", ""),
            "pretty_name": fields.get("PRETTY_NAME", "")}


def records():
    out = {}
    for key, path in RECORDS.items():
        try:
            with open(path, encoding="utf-8") as f:
                out[key] = f.read(RECORD_LIMIT)
        except OSError:
            out[key] = None
    return out


def collect():
    return {"schema": 1, "os": os_release(), "dpkg": dpkg_packages(), "python": python_distributions(),
            "python_version": "%d.%d.%d" % sys.version_info[:3], "records": records()}


if __name__ == "__main__":
    json.dump(collect(), sys.stdout, sort_keys=True)
    sys.stdout.write("\n")
