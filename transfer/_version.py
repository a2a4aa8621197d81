"""The package version, in a leaf module so the daemon can name it without importing `transfer`."""

__version__ = "0.1.0"
