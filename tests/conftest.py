"""Shared fixtures: nothing here starts processes; e2e helpers live in tests/e2e.

The hypothesis profile "long" is registered here (the root conftest loads before
`--hypothesis-profile` is read): `pytest tests/fuzz --hypothesis-profile=long`.
"""

from hypothesis import settings

settings.register_profile("long", max_examples=500, deadline=None)
