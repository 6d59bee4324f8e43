"""Apps: tools that a caller prompts, each a folder ``<workspace>/apps/<id>/`` with a
manifest, ``APP.md`` (docs/apps.md).

- :mod:`.manifest` - APP.md's format: text in, a validated ``AppManifest`` out, and
  back (pure, with the policy's layers);
- :mod:`.discovery` - finding the apps of a workspace on the host, safely, and the
  ``app_skipped`` audit entries for those that cannot be used (with the host resources).

The modules sit in different layers, so this namespace re-exports nothing: importing
the pure manifest must not import the discovery's file handling.
"""
