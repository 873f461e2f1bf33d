"""ditserve: command line and shared client-side helpers."""

__version__ = "0.1.0"
