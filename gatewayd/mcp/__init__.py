"""MCP servers behind the chokepoint: servers the operator declares, each run in a
sandbox of its own, whose pinned tools are gateway tools ``mcp.<server>.<tool>``
(docs/mcp.md).

- :mod:`.declaration` - one declared server (pure, read by the configuration);
- :mod:`.remote` - a server's tools and answers as plain data (pure);
- :mod:`.pinset` - pins, digests, the pin file and what changed (pure);
- :mod:`.pins` - the pin files on disk;
- :mod:`.client`, :mod:`.child`, :mod:`.servers` - a server's session, its sandbox, the
  supervisor of its instances;
- :mod:`.tools` - pinned tools as the tools of each run, and their calls;
- :mod:`.approval` - the operator's list, show, diff and pin.

The modules sit in different layers, so this namespace re-exports nothing.
"""
