"""gatewayd: the host daemon of cogni gateway."""

# Keep equal to [project] version in pyproject.toml (a test checks). Not read through
# importlib.metadata: that lookup alone costs tens of milliseconds at every start.
__version__ = "0.1.0"
