"""Step-time cost of structured output and penalties: ``python -m kthena_serve.bench.grammar``.

``--batch`` requests on the default model decode together, without a grammar (``none``), all
with a JSON schema (``json_schema``), half with it (``mixed``), and all with vLLM's three
penalties and no grammar (``penalties``: repetition 1.1, presence 0.5, frequency 0.5); the
rounds alternate (none, json_schema, mixed, penalties, again) so drift on a shared machine
hits each alike. Per round: the
median / p10 / p90 wall time of the decode steps where every request is running (prompts done,
none finished) and their median process CPU time (all threads: on a busy shared machine the
steadier figure), and the grammar's own parts per step: filling the batch's token bitmask
(xgrammar, one matcher per request) and applying it to the logits. One JSON line per round, the machine
described (``bench.machine.host_info``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time

import torch

from kthena_serve.bench.machine import host_info, wait_until_idle
from kthena_serve.engine.grammar import apply_token_bitmask
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.engine.structured_output import StructuredOutputsParams
from kthena_serve.llm import LLM

__all__ = ["SCHEMA", "measure"]

# Structure first (title, year, eight tags), then a long free string: every request stays in
# the batch for the whole run, and its steps cross both kinds of grammar state.
SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"title": {"type": "string", "maxLength": 40},
                         "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                  "minItems": 8, "maxItems": 8},
                         "summary": {"type": "string", "minLength": 2000}},
          "required": ["title", "year", "tags", "summary"]}
PENALTIES = {"repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": 0.5}
MODES = ("none", "json_schema", "mixed", "penalties")
PROMPT = "Describe a film you like as JSON (title, year, tags, summary). Film number {}:"
_IDS = itertools.count()


def _quantiles(values: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(values, n=10)
    return {"median_ms": round(statistics.median(values) * 1e3, 3),
            "p10_ms": round(qs[0] * 1e3, 3), "p90_ms": round(qs[-1] * 1e3, 3)}


class _Timed:
    """Times ``fill_bitmask`` of the engine's grammars (a bench-side wrapper) and keeps the last
    bitmask, to time its application alone afterwards."""

    def __init__(self, grammars) -> None:  # noqa: ANN001
        self._fill = grammars.fill_bitmask
        self.seconds: list[float] = []
        self.last: torch.Tensor | None = None
        grammars.fill_bitmask = self

    def __call__(self, matchers):  # noqa: ANN001, ANN204
        start = time.perf_counter()
        bitmask = self._fill(matchers)
        if bitmask is not None:
            self.seconds.append(time.perf_counter() - start)
            if self.last is None or len(bitmask) >= len(self.last):  # a full batch's
                self.last = bitmask
        return bitmask


def measure(llm: LLM, mode: str, batch: int, steps: int) -> dict[str, object]:
    """One round: ``batch`` requests, ``mode`` one of `MODES`; the result row."""
    engine = llm.engine
    timed = _Timed(engine.processor.grammars)
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    ids = []
    for i in range(batch):
        constrained = mode == "json_schema" or (mode == "mixed" and i % 2 == 0)
        params = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True,
                                structured_outputs=spec if constrained else None,
                                **(PENALTIES if mode == "penalties" else {}))
        ids.append(f"bench-{next(_IDS)}")
        engine.add_request(ids[-1], PROMPT.format(i), params)
    produced = dict.fromkeys(ids, 0)
    times: list[float] = []
    cpu_times: list[float] = []
    while engine.has_unfinished_requests():
        full = all(produced.values())  # every prompt done: this step decodes all of them
        start, cpu_start = time.perf_counter(), time.process_time()
        outs = engine.step()
        spent, cpu_spent = time.perf_counter() - start, time.process_time() - cpu_start
        for out in outs:
            produced[out.request_id] += len(out.new_token_ids)
        if full and len(outs) == batch and not any(o.finished for o in outs):
            times.append(spent)
            cpu_times.append(cpu_spent)
    engine.processor.grammars.fill_bitmask = timed._fill
    row: dict[str, object] = {"bench": "grammar_step", "mode": mode, "batch": batch,
                              "steps": len(times[3:]), **_quantiles(times[3:]),
                              "cpu_median_ms": round(statistics.median(cpu_times[3:]) * 1e3, 3)}
    if timed.seconds:
        row["fill_bitmask"] = _quantiles(timed.seconds[3:])
        row["apply_bitmask"] = _quantiles(_time_apply(timed.last, batch, mode,
                                                      engine.runner.model.config.shape.vocab_size))
    return row


def _time_apply(bitmask: torch.Tensor, batch: int, mode: str, vocab: int) -> list[float]:
    rows = list(range(batch)) if mode == "json_schema" else list(range(0, batch, 2))
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
    seconds = []
    for _ in range(50):
        work = logits.clone()
        start = time.perf_counter()
        apply_token_bitmask(work, bitmask, rows)
        seconds.append(time.perf_counter() - start)
    return seconds[5:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--batch", type=int, default=8, help="concurrent requests")
    parser.add_argument("--steps", type=int, default=64, help="decode steps per request")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the modes")
    args = parser.parse_args()
    torch.manual_seed(0)
    machine = host_info()
    llm = LLM(args.model, max_num_seqs=args.batch)
    measure(llm, "json_schema", args.batch, 8)  # warm-up: compile, caches, first steps
    for _ in range(args.rounds):
        for mode in MODES:
            waited = wait_until_idle()  # the machine is shared: start each round on a quiet one
            row = measure(llm, mode, args.batch, args.steps)
            row["waited_for_idle_s"] = round(waited, 1)
            row.update(model=args.model, threads=torch.get_num_threads(), **machine,
                       loadavg_after=[round(x, 2) for x in os.getloadavg()])
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
