"""The benchmark scripts: run each from the repository root as ``.venv/bin/python -m benchmarks.NAME`` (README.md)."""
