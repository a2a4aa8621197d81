"""The daemon: sessions, scheduler and dispatch on a trio event loop."""

from ._config import DaemonConfig
from ._daemon import run, serve
from ._server import Server

__all__ = ["DaemonConfig", "Server", "serve", "run"]
