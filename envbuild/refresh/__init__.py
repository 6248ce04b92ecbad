"""`envbuild matrix refresh`: derive the matrix's release facts from PyPI (see cli.py)."""

from .cli import refresh, refresh_command

__all__ = ["refresh", "refresh_command"]
