"""envbuild smoke test entry point: `python /opt/envbuild/smoke.py [--json] ...`.

Kept at this path for Apptainer %test and `envbuild smoke`; the code is the envbuild_image
package in lib/ next to this file (`python -m envbuild_image --help` with lib/ on sys.path is
the same program).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))

from envbuild_image.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
