"""One-off studies: run each from the repository root as ``.venv/bin/python -m benchmarks.studies.NAME``."""
