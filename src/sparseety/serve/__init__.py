"""``sparseety serve``: an OpenAI-compatible sparse server with Prometheus metrics and sampled tracing."""

from sparseety.serve.app import create_app
from sparseety.serve.config import ServeConfig

__all__ = ["ServeConfig", "create_app"]
