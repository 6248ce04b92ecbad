"""How many examples the property tests try: few in the fast suite, many in the opt-in long run
(ENVBUILD_PROPERTY_EXAMPLES=2000 python -m pytest tests/test_hostile_input.py tests/test_jobs.py
tests/test_command_properties.py -k 'test_any_ or sqsh')."""

import os

EXAMPLES = int(os.environ.get("ENVBUILD_PROPERTY_EXAMPLES") or 25)


def examples(fast: int) -> int:
    """A property whose example costs most of a second (a render, a publish plan) runs `fast`
    examples in the fast suite, and ENVBUILD_PROPERTY_EXAMPLES in the long run like the rest."""
    return EXAMPLES if os.environ.get("ENVBUILD_PROPERTY_EXAMPLES") else fast
