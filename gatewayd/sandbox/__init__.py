"""Launching sandboxed processes: network namespace, bubblewrap plan, seccomp, limits.

Each concern lives in its own module (``netns``, ``plan``, ...); import them directly.
This package imports nothing, so importing one piece never loads another's dependencies
(pyroute2 alone costs a quarter of a second).
"""
