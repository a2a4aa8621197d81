"""`transferd`: the transfer daemon.

Settings come from flags > ``TRANSFER_*`` environment > a TOML file
(``--config`` / ``$TRANSFER_CONFIG``) > defaults; `transfer._settings` holds
the schema. ``--print-config`` shows the effective values and where each came
from. ``python -m transfer`` is the same program.

Exit codes (docs/operations.md): 0 clean shutdown (or --version, --help,
--print-config), 1 startup failure (endpoint in use, refused bind, missing or
unusable shm dir, metrics port taken, --backend cupy without a usable GPU),
2 bad configuration or usage ("transferd: config error: ..."). Under systemd
(``Type=notify``) it reports READY=1 once it serves and STOPPING=1 when it
begins to drain (deploy/transferd.service).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from .._version import __version__
from .. import _settings as S
from ._systemd import notify

log = logging.getLogger("transfer.daemon")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="transferd",
        usage="%(prog)s [options]\n       %(prog)s keygen DIR   (CURVE keys for authenticated tcp: docs/operations.md)\n"
              "       %(prog)s top [--url URL]   (each tenant's bytes/s, requests/s, errors, live, from the metrics endpoint)",
        description="Zero-copy transfer daemon. Precedence: flags > TRANSFER_* env > --config file > defaults.",
        epilog="Sizes accept suffixes (64MiB, 16G). Booleans take --flag / --no-flag. docs/operations.md has the details.",
    )
    p.add_argument("--config", type=Path, default=None, metavar="FILE.toml", help=f"settings file (TOML; unknown keys are errors) [env {S.ENV_PREFIX}CONFIG]")
    p.add_argument(
        "--print-config",
        nargs="?",
        const="toml",
        choices=("toml", "json"),
        default=None,
        help="print the effective configuration with each value's source, then exit",
    )
    p.add_argument("--ready", action="store_true", help="print one JSON line to stdout once serving")
    p.add_argument("--version", action="version", version=version_text(), help="print the version and exit")
    S.add_flags(p)
    return p


def version_text() -> str:
    from ..protocol import VERSION

    return f"transferd {__version__} (protocol {VERSION}, Python {sys.version.split()[0]})"


def config_from_args(args: argparse.Namespace, env: dict[str, str] | None = None) -> S.Resolved:
    """Resolve flags, env and file into the effective settings (raises ConfigError)."""
    return S.resolve(S.flags_from_args(args), env, args.config)


def _serve_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        resolved = config_from_args(args)
        config = resolved.daemon_config()
    except (S.ConfigError, ValueError, TypeError) as exc:
        print(f"transferd: config error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(resolved.to_json() + "\n" if args.print_config == "json" else resolved.to_toml())
        return 0
    S.setup_logging(resolved["log_level"], resolved["log_json"])

    # Only the serving path needs these.
    import trio
    import zmq

    from ..server import serve

    async def main_task() -> None:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(functools.partial(serve, config, on_drain=lambda: notify(STOPPING=1, STATUS="draining")))
            metrics_port = server.metrics_port
            if args.ready:
                ready: dict[str, Any] = {
                    "event": "ready", "endpoints": list(config.endpoints), "backend": server.backend.name,
                    "backend_reason": server.backend_reason, "instance": server.instance,
                    "data_plane": server.dataplane.describe(),
                }
                if metrics_port:
                    ready["metrics"] = f"http://{config.metrics_addr}:{metrics_port}/metrics"
                print(json.dumps(ready), flush=True)
            notify(READY=1, MAINPID=os.getpid(), STATUS=f"serving {', '.join(config.endpoints)} ({server.backend.name})")

    try:
        trio.run(main_task)
    except BaseException as exc:  # startup failures arrive wrapped in exception groups
        leaf = _first_leaf(exc)
        if isinstance(leaf, (ValueError, RuntimeError, OSError, zmq.ZMQError)):
            print(f"transferd: {leaf}", file=sys.stderr)
            return 1
        raise
    return 0


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def main(argv: list[str] | None = None) -> int:
    """`transferd keygen DIR`: CURVE keys (transfer/cli/_keys.py); `transferd top`: a live view of
    the tenants (transfer/cli/_top.py); everything else serves."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keygen"]:
        from ._keys import main as keygen_main

        return keygen_main(argv[1:])
    if argv[:1] == ["top"]:
        from ._top import main as top_main

        return top_main(argv[1:])
    return _serve_main(argv)


if __name__ == "__main__":
    sys.exit(main())
