"""`gatewayd witness`: a transparency-log witness (C2SP tlog-witness) of its own.

It cosigns a log's checkpoint (C2SP tlog-cosignature/v1, Ed25519) only after checking a
consistency proof from the last checkpoint it cosigned for that log, keeps that state
durably (:mod:`~gatewayd.witness.state`), and refuses, logs and keeps as evidence a
checkpoint that rewrites the history it saw. The modules: ``request`` (the add-checkpoint
body, sans-IO), ``state`` (the durable per-log record), ``witness`` (the checks, in the
spec's order, and the cosignature), ``server`` (HTTP over trio and h11). docs/witness.md
says how to run one.
"""
