"""Scale-out: agent runs as Temporal workflows, executed by a `gatewayd worker` per host."""
