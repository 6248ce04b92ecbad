"""`python -m envbuild_image` (in the image, /opt/envbuild/lib on sys.path) runs the smoke test."""

import sys

from .cli import main

sys.exit(main())
