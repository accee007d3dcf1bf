"""LLM: the offline Python API — ``LLM(model=...).generate(prompts, SamplingParams(...))``.

Importing this module does not load torch: ``LLM(...)`` first decides OpenMP's wait policy for
this process (`kthena_serve.engine.threads.in_process_wait_policy`, read once when torch loads), then
builds the engine, which loads it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.request import RequestOutput
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.engine.threads import in_process_threads, in_process_wait_policy

if TYPE_CHECKING:
    from kthena_serve.model import Tokenizer

__all__ = ["LLM"]

Prompt = str | Sequence[int]


class LLM:
    """Generate for a batch of prompts with continuous batching.

    Args:
        model: ``"default"``, a checkpoint folder, a ``.gguf`` file or a Hub repo id
            ``ORG/NAME`` (`kthena_serve.model.source`).
        **engine_config: any other ``EngineConfig`` field (``max_num_seqs``, ``block_size`` ...).
            Without ``num_threads``, one engine (``tp`` and ``pp`` 1) runs one torch thread per
            core this process may use, or one thread if torch was imported before the first
            ``LLM`` with ``OMP_WAIT_POLICY`` unset (it logs a warning saying so). Without
            ``target_step_ms``, offline generation runs with decode protection off (0): it is
            throughput-only, nobody waits on a token.

    The first ``LLM`` in a process sets ``OMP_WAIT_POLICY=PASSIVE`` when it is unset and torch
    is not loaded yet, so that its threads sleep while idle instead of stalling on a busy
    machine; a value you exported is kept, and a process whose entry point decided already
    (the ``kthena`` command, ``python -m kthena_serve...``) keeps that (``kthena_serve.engine.threads``).

    Raises:
        kthena_serve.engine.config.ConfigError: an ``engine_config`` value is refused (a ``ValueError``).

    Example::

        llm = LLM(max_num_seqs=32)
        outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=16))
        print(outs[0].text)
    """

    def __init__(self, model: str = "default", **engine_config) -> None:
        in_process_wait_policy()  # before torch loads: OpenMP reads the policy once
        from kthena_serve.engine import LLMEngine

        engine_config.setdefault("target_step_ms", 0)  # offline: full steps (throughput)
        config = EngineConfig(model=model, **engine_config)
        if config.world_size == 1:  # parallel ranks are processes that set their own threads
            config = attrs.evolve(config, num_threads=in_process_threads(config.num_threads))
        self.engine = LLMEngine.from_config(config)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order.

        Args:
            prompts: a text, a list of texts, or lists of token ids. A text gets the
                tokenizer's special tokens (its BOS, where it adds one), as a completions
                prompt does on the server (``InputProcessor``'s encode rule); token ids are run
                as given.
            params: one SamplingParams for all, or one per prompt (default: SamplingParams()).
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        for request_id, prompt, p in zip(ids, prompts, params, strict=True):
            self.engine.add_request(request_id, prompt, p)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def close(self) -> None:
        """Release the KV pool and stop any parallel ranks (``tp`` / ``pp`` > 1); idempotent."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        """One chat turn: render the model's chat template (its special tokens only, as the
        chat route) and generate."""
        return self.generate(self.engine.processor.encode_chat(messages), params)[0]
