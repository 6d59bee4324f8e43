"""Agent runs: host-side repository operations (clone, patch, push, pull request)."""
