"""Run test code inside a decoy of the whole host: a private mount namespace whose ``/``
is an overlay of the real one, so a test may point gatewayd at /usr, /etc or ``/`` and a
regression damages only the decoy.

The real root is the overlay's read-only lower layer; every write, chown and chmod lands
on a tmpfs upper layer that vanishes with the namespace (``unshare -m --propagation
private``: nothing mounted inside reaches the host). ``/proc``, ``/sys`` and ``/dev`` are
the real ones, bound in (bwrap and gatewayd need them). ``pivot_root`` makes the overlay
the namespace's root (not ``chroot``: a chrooted process may not make the user
namespaces bwrap needs). Before any test code runs, ``findmnt`` must say that ``/`` and
every tree the test names lie on the decoy; otherwise the driver stops (exit
:data:`NOT_IN_PLACE`) and nothing runs.

The test code is Python run by this interpreter inside the decoy, with the checkout on
its path; it prints one JSON document as its last line of output, which
:func:`run_in_decoy_root` returns.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

ROOT = Path(__file__).resolve().parent.parent
DECOY_SOURCE: Final = "cogni-decoy"
# The driver's exit status when the decoy is not in place (nothing was run).
NOT_IN_PLACE: Final = 97
# The upper layer: what a run writes into the decoy. A regression that chowns a whole
# tree copies only metadata up (metacopy=on), so this is ample.
LAYER_BYTES: Final = 1 << 30
# gatewayd runs are a few seconds each; a table of them inside one decoy takes minutes.
DEFAULT_TIMEOUT_S: Final = 600

_DRIVER = r"""
set -eu
base=$1; python=$2; shift 2
mount -t tmpfs -o size={layer_bytes},mode=0700 {source}-layers "$base/layers"
mkdir "$base/layers/upper" "$base/layers/work"
mount -t overlay {source} \
    -o "metacopy=on,lowerdir=/,upperdir=$base/layers/upper,workdir=$base/layers/work" "$base/root"
for d in proc sys dev; do mount --rbind "/$d" "$base/root/$d"; done
cd "$base/root"
mkdir -p .cogni-old-root
pivot_root . .cogni-old-root
cd /
umount -l /.cogni-old-root
rmdir /.cogni-old-root
if [ "$(findmnt -n -o SOURCE,FSTYPE /)" != "{source} overlay" ]; then
    echo "the decoy root is not in place: $(findmnt -n -o SOURCE,FSTYPE /)" >&2
    exit {not_in_place}
fi
for tree in "$@"; do
    existing=$tree
    while [ ! -e "$existing" ]; do existing=$(dirname "$existing"); done
    if [ "$(findmnt -n -o SOURCE -T "$existing")" != {source} ]; then
        echo "$tree is not on the decoy: $(findmnt -n -o SOURCE,TARGET -T "$existing")" >&2
        exit {not_in_place}
    fi
done
cd {checkout}
exec env PYTHONPATH={checkout} LITELLM_LOCAL_MODEL_COST_MAP=True "$python" "$base/inside.py"
"""


def run_in_decoy_root(
    base: Path, code: str, *, trees: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S
) -> Any:
    """Run ``code`` (Python, dedented) as root inside a decoy root built in ``base`` (a
    fresh directory under /tmp); ``trees`` are the host paths the code will touch, each
    checked to lie on the decoy first. Returns the JSON of the code's last output line.

    Error handling: AssertionError with the driver's output when the decoy could not be
    made or checked, or the code failed.
    """
    (base / "root").mkdir()
    (base / "layers").mkdir()
    (base / "inside.py").write_text(textwrap.dedent(code))
    driver = _DRIVER.format(
        layer_bytes=LAYER_BYTES,
        source=DECOY_SOURCE,
        not_in_place=NOT_IN_PLACE,
        checkout=ROOT,
    )
    proc = subprocess.run(
        [
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            driver,
            "decoy-driver",
            str(base),
            sys.executable,
            *trees,
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert proc.returncode != NOT_IN_PLACE, f"the decoy was not in place: {proc.stderr}"
    assert proc.returncode == 0, f"the code in the decoy failed ({proc.returncode}): {proc.stderr}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"the code in the decoy printed nothing: {proc.stderr}"
    return json.loads(lines[-1])


# Helpers the inside code imports (``from tests.decoyroot import ...``); they run in the
# decoy only.

PROBE_SCRIPT: Final = "cogni-probe.sh"
PROBE_SETUID: Final = "cogni-probe-setuid"
PROBE_SETGID: Final = "cogni-probe-setgid"
PROBE_TEXT: Final = "#!/bin/sh\necho original\n"
# What a run that got the tree lent would do: rewrite the root-owned script root runs later.
ATTACK: Final = 'echo "echo PWNED" > /workspace/cogni-probe.sh'


def plant_probes(tree: str) -> list[str]:
    """In ``tree`` (made if missing): a root-owned script, a set-user-ID and a
    set-group-ID copy of /bin/true. Returns their paths. Only inside the decoy."""
    import os
    import shutil

    assert _on_decoy(tree), f"{tree} is not on the decoy"
    os.makedirs(tree, exist_ok=True)
    script = os.path.join(tree, PROBE_SCRIPT)
    with open(script, "w") as out:
        out.write(PROBE_TEXT)
    os.chown(script, 0, 0)
    os.chmod(script, 0o755)
    paths = [script]
    for name, mode in ((PROBE_SETUID, 0o4755), (PROBE_SETGID, 0o2755)):
        path = os.path.join(tree, name)
        shutil.copyfile("/bin/true", path)
        os.chown(path, 0, 0)
        os.chmod(path, mode)
        paths.append(path)
    return paths


def snapshot(paths: Sequence[str]) -> dict[str, list[Any]]:
    """Each path's owner, group, whole mode and content digest."""
    import hashlib
    import os

    shot: dict[str, list[Any]] = {}
    for path in paths:
        st = os.lstat(path)
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        shot[path] = [st.st_uid, st.st_gid, oct(st.st_mode), digest]
    return shot


def _on_decoy(path: str) -> bool:
    import os

    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    found = subprocess.run(
        ["findmnt", "-n", "-o", "SOURCE", "-T", existing],
        capture_output=True,
        text=True,
        check=False,
    )
    return found.stdout.strip() == DECOY_SOURCE
