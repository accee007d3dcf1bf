"""One API call's generations: its prompts x ``n`` choices as engine requests, merged.

Choice ``i`` of prompt ``p`` is engine request ``<id>-<p>-<i>`` and OpenAI choice index
``p * n + i``. Closing the merged stream (the client left) cancels every choice, and each
choice's stream aborts its engine request on the way out.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import attrs

from kthena_serve.client import EngineClient, KVSession
from kthena_serve.engine.request import EngineRequest, RequestOutput
from kthena_serve.engine.sampling_params import SamplingParams

__all__ = ["Job", "collect", "stream_choices"]


@attrs.frozen
class Job:
    """What to generate for one API call (each prompt checked once: ``max_tokens``)."""

    request_id: str
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]  # the resolved output budget of each prompt
    params: SamplingParams
    n: int = 1
    cache_salt: str | None = None
    kv: KVSession | None = None  # a PD worker's kv_transfer_params session (one choice)

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_index(self, choice: int) -> int:
        return choice // self.n

    def choice_params(self, choice: int) -> SamplingParams:
        """Distinct seeds per choice, so ``n`` seeded choices are not ``n`` copies."""
        seed = self.params.seed
        if seed is None or self.n == 1:
            return self.params
        return attrs.evolve(self.params, seed=(seed + choice % self.n) % 2**64)  # stays in range


    def engine_request(self, choice: int) -> EngineRequest:
        index = self.prompt_index(choice)
        return EngineRequest(f"{self.request_id}-{index}-{choice % self.n}", self.prompts[index],
                             self.choice_params(choice), self.max_tokens[index], self.cache_salt)


def _generate(engine: EngineClient, job: Job, choice: int) -> AsyncIterator[RequestOutput]:
    return (engine if job.kv is None else job.kv).generate(job.engine_request(choice))


async def stream_choices(engine: EngineClient, job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield ``(choice index, output)`` as any choice makes progress."""
    if job.num_choices == 1:
        async for out in _generate(engine, job, 0):
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(choice: int) -> None:
        try:
            async for out in _generate(engine, job, choice):
                await queue.put((choice, out))
        except Exception as error:  # surfaced to the consumer below
            await queue.put((choice, error))

    tasks = [asyncio.create_task(pump(c)) for c in range(job.num_choices)]
    remaining = job.num_choices
    try:
        while remaining:
            choice, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            remaining -= item.finished
            yield choice, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(engine: EngineClient, job: Job) -> list[RequestOutput]:
    """Run every choice to the end; final outputs in choice order."""
    finals: list[RequestOutput | None] = [None] * job.num_choices
    async for choice, out in stream_choices(engine, job):
        if out.finished:
            finals[choice] = out
    return finals  # type: ignore[return-value]
