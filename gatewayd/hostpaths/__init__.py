"""The host side of a run's path grants, shared by the fs tools, workspaces and runs.

- :mod:`.binding` — a policy's path rules bound to host directories when a run starts:
  resolved once, checked, each root's identity pinned
- :mod:`.beneath` — opening a path beneath a grant's root so that no component
  (symlink, ``..``, magic link, hard link) can lead out of it

The policy (:mod:`gatewayd.policy`) decides on paths as text and never touches the
host; these modules are where its grants meet the filesystem.
"""
