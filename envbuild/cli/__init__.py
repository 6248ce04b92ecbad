"""The `envbuild` command line: it parses options and delegates; each command's work lives in
the module that owns it (resolve, plan, render, build, verdict, publish, ...). Commands are
grouped by what they act on: a stack image (stack.py), a layer on one (layer.py), a built
image (image.py), the matrix (matrix.py), its locks (lock.py), reproducing and comparing images
(reproduce.py), the extension build cache (cache.py), publishing and verifying a published tag
(supply.py)."""

from envbuild.cli import cache, cluster, image, layer, lock, matrix, reproduce, stack, supply  # noqa: F401  (each registers its commands on `main`)
from envbuild.cli.app import main, refuse_repeated_options, run

refuse_repeated_options(main)

__all__ = ["main", "run"]
