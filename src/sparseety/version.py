"""The installed package's version (ground floor: traces record it without importing the package's facade)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("sparseety")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+local"
