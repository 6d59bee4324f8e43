"""The host file tools: ``fs.read``, ``fs.write``, ``fs.edit``, ``fs.list``, ``fs.stat``.

Each tool is an argument Struct (its JSON Schema is what ``tools.list`` shows), a
pure request (``read_request(args)`` …) saying which visible paths it touches and how,
within the files its manifest declares (every path the run's grants allow: read for
``fs.read``, ``fs.list`` and ``fs.stat``, read and write for ``fs.write`` and
``fs.edit``), and an async runner
that does the blocking I/O in a worker thread (the daemon serves every run on one
trio loop). Every open goes through :mod:`gatewayd.hostpaths.beneath`, so no path
component can lead outside the grant's root; results and messages carry visible
paths only. The rules (symlinks, hard links, special files, sizes) are written
down for agents and operators in ``docs/tools.md``.

The modules: ``read`` (``fs.read``), ``listing`` (``fs.list`` and ``fs.stat``, which
describe entries alike), ``write`` (``fs.write`` and ``fs.edit``), and what they share:
``bounds`` (what the tools declare, the path argument, per-file size limits, the
bounded read) and ``threads`` (how the blocking work runs: a read is abandoned on
cancel, a write runs to its end).
"""
