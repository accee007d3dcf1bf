"""PDCluster: a whole PD deployment embedded in one object: launcher + router + OpenAI server
(tests, bench, embedding in an application).

Example::

    with PDCluster(EngineConfig(num_kv_blocks=256), PDConfig(policy="fail")) as cluster:
        httpx.post(f"{cluster.url}/v1/completions", json={...})
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

from kthena_serve.cluster.auth import auth_headers
from kthena_serve.cluster.router import Router
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.kv_offload import shares_store
from kthena_serve.pd.config import PDConfig
from kthena_serve.pd.frontend import RemoteEngine, build_router_app
from kthena_serve.pd.launcher import PDLauncher
from kthena_serve.pd.metrics import PDMetrics
from kthena_serve.server import BackgroundServer
from mooncake_kv import shared_pool_paths

if TYPE_CHECKING:
    from kthena_serve.model import Tokenizer

__all__ = ["PDCluster", "shm_pools"]


def shm_pools() -> list[str]:
    """KV pool files in /dev/shm (leak checks)."""
    return [str(path) for path in shared_pool_paths()]


class PDCluster:
    """Workers on split cores, a router, and the OpenAI app on a free local port."""

    def __init__(self, engine_config: EngineConfig, pd_config: PDConfig, *,
                 num_prefill: int = 1, num_decode: int = 1, model_name: str = "default",
                 tokenizer: Tokenizer | None = None, **launcher_options: Any) -> None:
        self.engine_config = engine_config
        self.pd_config = pd_config
        self.launcher = PDLauncher(engine_config, pd_config, num_prefill, num_decode,
                                   quiet=True, **launcher_options)
        self.model_name = model_name
        self._tokenizer = tokenizer
        self.router: Router | None = None
        self.server: BackgroundServer | None = None

    def start(self) -> PDCluster:
        self.launcher.start()
        try:
            secret = self.launcher.secret
            self.router = Router(self.launcher.endpoints(), self.pd_config,
                                 self.engine_config.block_size, PDMetrics("router"),
                                 secret=secret,
                                 hash_algo=self.engine_config.hash_algorithm,
                                 shared_store=shares_store(self.engine_config)).start()
            self.launcher.on_restart = self.router.set_url
            remote = RemoteEngine.for_model(self.router, self.engine_config, self._tokenizer,
                                            secret=secret)
            app = build_router_app(remote, model_name=self.model_name)
            self.server = BackgroundServer(app).start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.router is not None:
            self.router.close()
        self.launcher.stop()

    def __enter__(self) -> PDCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    @property
    def worker_headers(self) -> dict[str, str]:
        """What a call to a worker's control API needs (the deployment secret)."""
        return auth_headers(self.launcher.secret)

    def worker_state(self, name: str) -> dict:
        return httpx.get(f"{self.launcher.url(name)}/pd/state", params={"since": 1 << 62},
                         headers=self.worker_headers, timeout=5).json()

    def worker_metrics(self, name: str) -> str:
        return httpx.get(f"{self.launcher.url(name)}/metrics", headers=self.worker_headers,
                         timeout=5).text

    def complete(self, prompt: str | list[int] | list[str], max_tokens: int = 16,
                 timeout: float = 120, **extra: Any) -> httpx.Response:
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, **extra}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=timeout)
