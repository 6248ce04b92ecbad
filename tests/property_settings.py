"""How many examples the property tests try: few in the fast suite, many in the opt-in long run
(ENVBUILD_PROPERTY_EXAMPLES=2000 python -m pytest tests/property/test_hostile_input_properties.py
tests/property/test_jobs_properties.py tests/property/test_command_properties.py -k 'test_any_ or sqsh'; every
property of the suite lies in tests/property)."""

import os

EXAMPLES = int(os.environ.get("ENVBUILD_PROPERTY_EXAMPLES") or 25)


def examples(fast: int) -> int:
    """A property whose example costs most of a second (a render, a publish plan) runs `fast`
    examples in the fast suite, and ENVBUILD_PROPERTY_EXAMPLES in the long run like the rest."""
    return EXAMPLES if os.environ.get("ENVBUILD_PROPERTY_EXAMPLES") else fast
