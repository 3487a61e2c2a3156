"""Where a deployed run may read and write on the SuperLink's machine.

In a deployment the experiment's paths (the ``config`` file, ``data.path``, ``output-dir``, ``resume``) come from
whoever runs ``flwr run``, not from the machine's operator. They are confined to roots the operator sets in the
environment of the SuperLink (which its ServerApp processes inherit) or of the ServerApp executor:

    FEDSSL_ALLOWED_ROOTS=/data:/srv/fedssl/outputs flower-superlink ...

(``os.pathsep``-separated folders). Without it the root is ``./outputs`` under the ServerApp's working directory;
the app's own folder (its ``configs/``) is always allowed. A path outside every root stops the run with an error naming it and the roots.
In a local simulation the person who runs ``flwr run`` is the operator: nothing is confined there.
"""

from __future__ import annotations

import os
from pathlib import Path

from ssl_models.config import ConfigError

ROOTS_VARIABLE = "FEDSSL_ALLOWED_ROOTS"


def allowed_roots(app_dir: Path) -> list[Path]:
    """The app's own folder, plus the operator's roots (``$FEDSSL_ALLOWED_ROOTS``) or else ``./outputs``; resolved."""
    value = os.environ.get(ROOTS_VARIABLE, "")
    roots = [Path(p) for p in value.split(os.pathsep) if p.strip()] if value.strip() else [Path.cwd() / "outputs"]
    return [p.expanduser().resolve() for p in [Path(app_dir), *roots]]


def confine(path: str | Path, key: str, roots: list[Path]) -> Path:
    """``path`` resolved (symlinks followed, so a link cannot lead out), if it lies inside one of ``roots``; else
    ConfigError naming ``key``, the path as given and the roots."""
    resolved = Path(path).expanduser().resolve()
    if any(resolved == root or resolved.is_relative_to(root) for root in roots):
        return resolved
    raise ConfigError(
        f"{key}: {str(path)!r} resolves to {resolved}, outside the folders this machine's operator "
        f"allows ({', '.join(str(r) for r in roots)}); the operator sets them with {ROOTS_VARIABLE} "
        "where the SuperLink (or the ServerApp executor) runs"
    )
