"""Where gatewayd's configuration is and what it defaults to, for what a client command
needs without the configuration's models (pydantic and every setting's checks, gatewayd/
config.py): the file, the variables' prefix, the state directory and the agent
directory beside it. gatewayd/config.py and gatewayd/configsources.py take them from
here; gatewayd/cli/options.py finds the control socket with them when nothing but the
defaults and ``--state-dir`` could set it.

Paths here are strings: pathlib (with the urllib.parse and ipaddress it imports) is a
tenth of a client command's start.
"""

from __future__ import annotations

import posixpath

# typing's flag without importing typing: client commands start without it
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Final

DEFAULT_CONFIG_PATH: Final = "/etc/gatewayd/gatewayd.yaml"
# The variable naming the file; it cannot be a setting in the file it names.
CONFIG_ENV: Final = "GATEWAYD_CONFIG"
ENV_PREFIX: Final = "GATEWAYD_"
DEFAULT_STATE_DIR: Final = "/var/lib/gatewayd"


def agent_dir_for(state_dir: str) -> str:
    """Where agent runs keep their clones by default: beside the state directory (a
    path as pathlib writes it: no trailing or doubled "/", no "." part)."""
    if not posixpath.basename(state_dir):  # "/" has no name to put a sibling beside
        return posixpath.join(state_dir, "gatewayd-agent")
    return state_dir + "-agent"
