"""`transferd keygen DIR [--client NAME ...]`: CURVE keys for the tcp control plane.

Creates (keeping what exists, so it can be re-run to add clients)::

    DIR/server.key, DIR/server.key_secret      the daemon's pair; give server.key to clients
    DIR/clients/NAME.key, NAME.key_secret       one pair per client (default NAME: client)
    DIR/authorized_clients/NAME.key             the daemon's allowlist (public keys)

Then: ``transferd --endpoint tcp://0.0.0.0:5555 --curve-dir DIR`` and, on the
producer, ``transfer.connect("tcp://host:5555", server_key="DIR/server.key",
client_keys="DIR/clients/NAME.key_secret")``. Secret files are mode 0600 in
0700 directories. Restart the daemon after adding clients.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

__all__ = ["keygen", "main"]


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def keygen(directory: str | os.PathLike[str], clients: list[str] | tuple[str, ...] = ("client",)) -> dict[str, str]:
    """Create the server pair (if missing) and a pair per client name; return the paths."""
    import zmq.auth

    root = Path(directory)
    _private_dir(root)
    _private_dir(root / "clients")
    _private_dir(root / "authorized_clients")
    out: dict[str, str] = {}
    if not (root / "server.key_secret").exists():
        zmq.auth.create_certificates(str(root), "server")
    os.chmod(root / "server.key_secret", 0o600)
    out["server_key"] = str(root / "server.key")
    out["server_secret"] = str(root / "server.key_secret")
    for name in clients:
        if not name or "/" in name or name.startswith(".") or name == "server":
            raise ValueError(f"bad client name {name!r}")
        secret = root / "clients" / f"{name}.key_secret"
        if not secret.exists():
            zmq.auth.create_certificates(str(root / "clients"), name)
        os.chmod(secret, 0o600)
        shutil.copyfile(root / "clients" / f"{name}.key", root / "authorized_clients" / f"{name}.key")
        out[f"client:{name}"] = str(secret)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="transferd keygen", description="Make CURVE keys for transferd's tcp endpoints.")
    p.add_argument("directory", type=Path)
    p.add_argument("--client", action="append", default=None, metavar="NAME", help="client key pair to add (repeatable; default: client)")
    args = p.parse_args(argv)
    try:
        paths = keygen(args.directory, args.client or ["client"])
    except (OSError, ValueError) as exc:
        print(f"transferd keygen: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(paths, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
