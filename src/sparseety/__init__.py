"""SparSEEty: make the token flow of sparse LLM inference visible and measurable."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("sparseety")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+local"

__all__ = ["__version__"]
