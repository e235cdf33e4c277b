"""OpenAI-compatible HTTP API over the engine, with /health and Prometheus /metrics (DESIGN.md §3.6)."""

from hybridlm.server.app import create_app, serve

__all__ = ["create_app", "serve"]
