"""`transferd`: the transfer daemon.

Settings come from flags > ``TRANSFER_*`` environment > a TOML file
(``--config`` / ``$TRANSFER_CONFIG``) > defaults; `transfer._settings` holds
the schema. ``--print-config`` shows the effective values and where each came
from. Exit codes: 0 clean shutdown, 1 startup failure (endpoint busy,
refused bind, unusable shm dir), 2 bad configuration or usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from .. import _settings as S

log = logging.getLogger("transfer.daemon")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="transferd",
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
    S.add_flags(p)
    return p


def config_from_args(args: argparse.Namespace, env: dict[str, str] | None = None) -> S.Resolved:
    """Resolve flags, env and file into the effective settings (raises ConfigError)."""
    return S.resolve(S.flags_from_args(args), env, args.config)


def main(argv: list[str] | None = None) -> int:
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
            server = await nursery.start(serve, config)
            metrics_port = _start_metrics(server, config) if config.metrics_port else 0
            if args.ready:
                ready: dict[str, Any] = {
                    "event": "ready", "endpoints": list(config.endpoints), "backend": server.backend.name,
                    "backend_reason": server.backend_reason, "instance": server.instance,
                }
                if metrics_port:
                    ready["metrics"] = f"http://{config.metrics_addr}:{metrics_port}/metrics"
                print(json.dumps(ready), flush=True)

    try:
        trio.run(main_task)
    except BaseException as exc:  # startup failures arrive wrapped in exception groups
        leaf = _first_leaf(exc)
        if isinstance(leaf, (ValueError, RuntimeError, OSError, zmq.ZMQError)):
            print(f"transferd: {leaf}", file=sys.stderr)
            return 1
        raise
    return 0


def _start_metrics(server: Any, config: Any) -> int:
    """Expose the server's Metrics (or, until the server has one, its Stats counters)."""
    from ..server._metrics import Metrics

    metrics = getattr(server, "metrics", None)
    if not isinstance(metrics, Metrics):
        metrics = Metrics()
        try:
            server.metrics = metrics
        except AttributeError:  # a slotted Server: the endpoint still serves the Stats counters
            pass
    metrics.set_stats_source(server.stats)
    port = metrics.start_http(config.metrics_port, config.metrics_addr)
    log.info("metrics on http://%s:%d/metrics", config.metrics_addr, port)
    return port


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc



# `transferd keygen DIR`: CURVE keys (transfer/cli/_keys.py); everything else serves.
_serve_main = main


def main(argv: list[str] | None = None) -> int:  # noqa: F811
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keygen"]:
        from ._keys import main as keygen_main

        return keygen_main(argv[1:])
    return _serve_main(argv)


if __name__ == "__main__":
    sys.exit(main())
