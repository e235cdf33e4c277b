"""OpenAI-compatible HTTP API over the engine, with /health and Prometheus /metrics (DESIGN.md §3.6)."""

from hybridlm.server.app import Limits, create_app, serve

__all__ = ["Limits", "create_app", "serve"]
