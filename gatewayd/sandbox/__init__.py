"""Launching sandboxed processes: network namespace, bubblewrap plan, seccomp, limits.

What each layer protects, and what none of them does: docs/sandbox.md.

Each concern lives in its own module (``netns``, ``plan``, ...); import them directly.
This package imports nothing, so importing one piece never loads another's dependencies
(pyroute2 alone costs a quarter of a second).
"""
