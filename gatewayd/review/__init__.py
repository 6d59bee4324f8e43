"""LLM rule review: a separate model checks a run's tool calls against the
policy's plain-language allow and deny rules before they run.

The pure core, each module one idea and none doing I/O or reading a clock:

- :mod:`.ruleset` - the rules and settings a verdict depends on, and their stable hash.
- :mod:`.structured` - deterministic rules (tool glob, path, regex, domain, numeric
  bound), decided before any model is asked.
- :mod:`.prompt` - the reviewer's chat messages, with the call as delimited JSON data.
- :mod:`.verdict` - the reviewer's answer parsed into allow or deny, failing closed.
- :mod:`.cache` - verdicts remembered per rule set, tool and arguments.
"""
