"""Moved to ``vmmkv.testing.markers``; this re-export goes once every test imports it there."""

from ..testing.markers import requires_gpu

__all__ = ["requires_gpu"]
