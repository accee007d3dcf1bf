"""The OpenAI-compatible HTTP server over the async engine (FastAPI + uvicorn).

Names are imported lazily, so a caller that needs one light module of this package (the stats
line's interval, the listener) does not import the app, and torch with it.
"""

from kthena_core.lazy import lazy_exports

_EXPORTS = {"build_app": "app", "BackgroundServer": "launch", "run_server": "launch"}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
