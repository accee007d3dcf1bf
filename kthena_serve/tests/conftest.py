"""Makes this folder's shared test helpers (``_netns``, ``_tiny``, ``_model_testing``,
``_kthena_proxy``, ...) importable; the transformers reference model shared by the modules
that compare against it, and the colocated engine of the PD tests."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def hf_gguf_model():
    """The default model as transformers reads its GGUF file (float32, eval): the independent
    reference of the parity and logprob tests. Loaded once per session (about 15 s here)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    known = pytest.importorskip("kthena_core.known_models")
    folder, name = os.path.split(known.default_gguf_path())
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def colocated():
    """A colocated engine with the PD workers' settings (``_tiny.PD_ENGINE``), one thread: the
    reference a PD test compares its workers' greedy text with (``_tiny.greedy_text``). One
    per module that asks for it."""
    from _tiny import PD_ENGINE

    from kthena_serve.engine import LLMEngine
    from kthena_serve.engine.config import EngineConfig

    engine = LLMEngine.from_config(EngineConfig(**PD_ENGINE, num_threads=1))
    yield engine
    engine.close()


# A file that serves a tiny engine defines ``served`` (``_tiny.tiny_server``: the engine and a
# client of its app); these split it. A file with its own ``engine`` or ``client`` overrides them.
@pytest.fixture(scope="module")
def engine(served):  # noqa: ANN001, ANN201
    return served[0]


@pytest.fixture(scope="module")
def client(served):  # noqa: ANN001, ANN201
    return served[1]
