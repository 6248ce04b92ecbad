"""import_check.py MANIFEST NAME...: import the top-level modules of each distribution NAME
and record them in MANIFEST's extend.imports; any failed import fails the build.

Modules come from the distribution's top_level.txt, else from its RECORD (top-level packages
and modules); private ones (a leading underscore) are skipped. Stdlib only: runs in the image.
"""

import importlib
import json
import sys
from importlib import metadata


def modules(name):
    dist = metadata.distribution(name)
    text = dist.read_text("top_level.txt")
    if text:
        found = {line.strip() for line in text.splitlines() if line.strip()}
    else:
        found = set()
        for path in dist.files or ():
            first = path.parts[0]
            if first.endswith((".dist-info", ".data")) or first in ("..", "__pycache__", "bin"):
                continue
            if len(path.parts) > 1 or first.endswith(".py"):
                found.add(first[:-3] if first.endswith(".py") else first)
    return sorted(m for m in found if m.isidentifier() and not m.startswith("_"))


def main():
    manifest_path, names = sys.argv[1], sys.argv[2:]
    imports, failed = {}, []
    for name in names:
        imports[name] = modules(name)
        for module in imports[name]:
            try:
                importlib.import_module(module)
            except Exception as error:  # noqa: BLE001 -- any failure is the finding
                failed.append(f"{name}: import {module}: {type(error).__name__}: {error}")
    if failed:
        sys.exit("envbuild: the import check failed:\n  " + "\n  ".join(failed))
    with open(manifest_path, encoding="utf-8") as handle:
        manifest = json.load(handle)
    manifest.setdefault("extend", {})["imports"] = imports
    with open(manifest_path, "w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=2)
        handle.write("\n")
    print("envbuild: imported " + ", ".join(f"{n} ({', '.join(m) or 'no modules'})" for n, m in imports.items()))


if __name__ == "__main__":
    main()
