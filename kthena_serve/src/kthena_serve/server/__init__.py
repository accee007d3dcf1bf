"""The OpenAI-compatible HTTP server over the async engine (FastAPI + uvicorn)."""

from kthena_serve.server.app import build_app
from kthena_serve.server.launch import BackgroundServer, run_server

__all__ = ["BackgroundServer", "build_app", "run_server"]
