"""`transferd`: the transfer daemon."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import trio
import zmq

from ..protocol import Limits
from ..server import DaemonConfig, serve
from ..transport._zmq import default_endpoint


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="transferd", description="Zero-copy transfer daemon.")
    p.add_argument("--endpoint", action="append", help=f"ipc://PATH or tcp://127.0.0.1:PORT (repeatable; default {default_endpoint()})")
    p.add_argument("--backend", choices=("auto", "cupy", "numpy"), default="auto")
    p.add_argument("--devices", type=int, default=1, help="virtual CPU devices for the numpy backend")
    p.add_argument("--shm-dir", type=Path, default=None, help="where shared-memory segments live (default /dev/shm)")
    p.add_argument("--heartbeat", type=float, default=1.0, help="seconds between client heartbeats")
    p.add_argument("--session-timeout", type=float, default=10.0, help="reclaim a session silent this long")
    p.add_argument("--max-frame-bytes", type=int, default=Limits().max_frame_bytes)
    p.add_argument("--max-device-bytes", type=int, default=16 << 30)
    p.add_argument("--threads", type=int, default=2, help="worker threads for large copies")
    p.add_argument("--allow-remote-tcp", action="store_true", help="bind tcp on non-loopback addresses (unauthenticated!)")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--ready", action="store_true", help="print one JSON line to stdout once serving")
    return p


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    kw: dict[str, object] = {}
    if args.shm_dir is not None:
        kw["shm_dir"] = args.shm_dir
    return DaemonConfig(
        endpoints=tuple(args.endpoint or [default_endpoint()]),
        backend=args.backend,
        devices=args.devices,
        limits=Limits(max_frame_bytes=args.max_frame_bytes),
        heartbeat_s=args.heartbeat,
        session_timeout_s=args.session_timeout,
        max_device_bytes=args.max_device_bytes,
        threads=args.threads,
        allow_remote_tcp=args.allow_remote_tcp,
        **kw,  # type: ignore[arg-type]
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = config_from_args(args)
    except (ValueError, TypeError) as exc:
        print(f"transferd: {exc}", file=sys.stderr)
        return 2

    async def main_task() -> None:
        async with trio.open_nursery() as nursery:
            server = await nursery.start(serve, config)
            if args.ready:
                print(json.dumps({"event": "ready", "endpoints": list(config.endpoints), "backend": server.backend.name, "instance": server.instance}), flush=True)

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


if __name__ == "__main__":
    sys.exit(main())
