"""Makes this folder's shared test helpers (``_netns``, ``_tiny``, ``_model_testing``,
``_kthena_proxy``, ...) importable, and the transformers reference model shared by the modules
that compare against it."""

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
