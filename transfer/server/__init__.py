"""The daemon: sessions, scheduler and dispatch on a trio event loop."""

from ._config import DaemonConfig
from ._daemon import run, serve
from ._embedded import DeviceView, EmbeddedDaemon, serve_in_process
from ._server import Server

__all__ = ["DaemonConfig", "Server", "serve", "run", "serve_in_process", "EmbeddedDaemon", "DeviceView"]
