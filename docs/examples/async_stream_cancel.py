"""Streaming from ``AsyncLLM``, and the two ways a stream ends early.

    python docs/examples/async_stream_cancel.py

Three requests stream concurrently from one engine (the default model, SmolLM2-135M-Instruct):

* ``full``: read to the end (64 tokens);
* ``early``: the consumer leaves its ``async for`` after 4 outputs, as a server does when the
  HTTP client disconnects; leaving the loop aborts the request on the engine thread;
* ``cancelled``: its task is cancelled from outside once its first token arrived (a timeout
  or a shutdown does this), which aborts it the same way.

The code talks to the engine only through ``EngineClient``, the seam the OpenAI server uses
(``AsyncLLM`` in process, ``RemoteEngine`` for PD), and checks at the end that the engine runs
nothing and holds no KV block: the aborted requests gave their blocks back.
"""

import asyncio
import time

from kthena_serve import AsyncLLM, EngineConfig, SamplingParams
from kthena_serve.client import EngineClient
from kthena_serve.engine.request import EngineRequest, FinishReason

PARAMS = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def make_request(client: EngineClient, request_id: str, prompt: str) -> EngineRequest:
    """Tokenise and validate once, as the server does (``InvalidRequestError`` if refused)."""
    return client.processor.make_request(request_id, prompt, PARAMS)


async def consume(client: EngineClient, request: EngineRequest, max_outputs: int | None = None,
                  started: asyncio.Event | None = None) -> tuple[str, FinishReason | None, int]:
    """Stream a request; stop after ``max_outputs`` outputs (leaving the loop aborts it)."""
    text, reason, num_outputs = "", None, 0
    async for out in client.generate(request):
        text, reason, num_outputs = text + out.new_text, out.finish_reason, num_outputs + 1
        if started is not None:
            started.set()
        if num_outputs == max_outputs:
            break
    return text, reason, num_outputs


async def wait_until_idle(client: EngineClient, timeout_s: float = 30) -> None:
    """Aborts run on the engine thread: wait for it to have freed everything."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        if stats.num_running == stats.num_waiting == stats.kv.num_used_blocks == 0:
            return
        assert time.monotonic() < deadline, f"engine not idle after {timeout_s} s: {stats}"
        await asyncio.sleep(0.05)


async def main(client: EngineClient) -> None:
    full = make_request(client, "full", "Write a long story about the sea:")
    early = make_request(client, "early", "List every colour you know:")
    cancelled = make_request(client, "cancelled", "Count from one to a hundred:")
    started = asyncio.Event()
    cancelled_task = asyncio.create_task(consume(client, cancelled, started=started))
    both = asyncio.gather(consume(client, full), consume(client, early, max_outputs=4))
    await started.wait()
    cancelled_task.cancel()  # the stream's `finally` sends the abort to the engine thread
    (text, reason, num_outputs), (_, early_reason, early_outputs) = await both
    assert reason is FinishReason.LENGTH and num_outputs >= 1, (reason, num_outputs)
    assert early_outputs == 4 and early_reason is None, "the early stream was still running"
    assert cancelled_task.cancelled()
    await wait_until_idle(client)
    print(f"full: {text[:60]!r}... ({reason.value}); early: left after {early_outputs} "
          f"outputs; cancelled: after its first token; the engine is idle and holds no KV block")


if __name__ == "__main__":
    engine = AsyncLLM.from_config(EngineConfig(kv_cache_memory="64MiB", max_num_seqs=4)).start()
    try:
        asyncio.run(main(engine))
    finally:
        engine.shutdown()
