"""Moved to ``vmmkv.testing.spawn``; this re-export goes once every test imports it from there."""

from vmmkv.testing.spawn import *  # noqa: F401,F403
from vmmkv.testing.spawn import __all__  # noqa: F401
