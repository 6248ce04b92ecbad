"""How many examples the property tests try: few in the fast suite, many in the opt-in long run
(ENVBUILD_PROPERTY_EXAMPLES=2000 python -m pytest tests/test_hostile_input.py tests/test_jobs.py -k test_any_)."""

import os

EXAMPLES = int(os.environ.get("ENVBUILD_PROPERTY_EXAMPLES") or 25)
