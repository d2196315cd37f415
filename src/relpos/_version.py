"""The package version (one place; the facade and the command line read it)."""

__version__ = "0.1.0"
