"""`envbuild matrix refresh`: derive the matrix's release facts from PyPI (see cli.py)."""

from envbuild.refresh.catalogue_cli import catalogue_command
from envbuild.refresh.cli import refresh, refresh_command

__all__ = ["catalogue_command", "refresh", "refresh_command"]
