"""The package version (one place; the package, the server and evaluation records read it)."""

__version__ = "0.1.0"
