"""What every rule answers: a :class:`Rejection` names its rule and says why, never a bare
boolean, so ``--explain`` and the error messages can say which rule rejected what."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rejection:
    rule: str
    message: str
