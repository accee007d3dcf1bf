"""The scheduler's decode protection (``prefill_budget``), without a model: golden tests pin
each step's contents with a fixed budget; the Hypothesis state machine in
test_scheduler_state.py checks the bound and that every prompt finishes under random traffic.
"""

from __future__ import annotations

import random

from kthena_serve.engine.request import FinishReason, Request
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.engine.scheduler import Scheduler
from mooncake_kv import KVCacheManager

BLOCK = 4


class Recorder:
    """A fixed prefill budget that records the decode rows and the burst's prompt tokens it was
    asked about."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.asked: list[int] = []
        self.burst: list[int] = []

    def __call__(self, num_decode_rows: int, num_burst_tokens: int) -> int:
        self.asked.append(num_decode_rows)
        self.burst.append(num_burst_tokens)
        return self.tokens


def _scheduler(budget: Recorder | None, *, num_blocks: int = 64, max_tokens: int = 64,
               caching: bool = True, burst_window_s: float = 0.0) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=caching,
                        check_invariants=True)
    return Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=max_tokens,
                     enable_prefix_caching=caching, prefill_budget=budget,
                     burst_window_s=burst_window_s)


def _request(rid: str, length: int, max_tokens: int = 50) -> Request:
    rng = random.Random(rid)
    return Request(rid, [rng.randrange(1000) for _ in range(length)],
                   SamplingParams(max_tokens=max_tokens))


def _step(scheduler: Scheduler) -> list[tuple[str, int]]:
    """Schedule, 'run', update; sampled requests get token 7 (finishing at max_tokens)."""
    batch = scheduler.schedule()
    scheduler.update(batch)
    running = {r.request_id: r for r in scheduler.running}
    for seq in batch.seqs:
        if seq.is_sampled:
            request = running[seq.request_id]
            request.token_ids.append(7)
            if request.num_output_tokens >= request.params.max_tokens:
                scheduler.finish(request, FinishReason.LENGTH)
    return [(seq.request_id, len(seq.token_ids)) for seq in batch.seqs]


def _decoding(scheduler: Scheduler, rid: str = "d") -> None:
    scheduler.add(_request(rid, 6))
    assert _step(scheduler) == [(rid, 6)]  # its prompt; it decodes from now on


def test_a_prompt_arriving_while_one_decodes_is_split_to_the_budget():
    budget = Recorder(8)
    scheduler = _scheduler(budget)
    _decoding(scheduler)
    scheduler.add(_request("p", 30))
    steps = [_step(scheduler) for _ in range(5)]
    assert steps == [[("d", 1), ("p", 8)], [("d", 1), ("p", 8)], [("d", 1), ("p", 8)],
                     [("d", 1), ("p", 6)], [("d", 1), ("p", 1)]]
    assert budget.asked == [1, 1, 1, 1, 2]  # the step's decode rows: p decodes in the 5th


def test_without_a_budget_the_prompt_takes_the_whole_step():
    scheduler = _scheduler(None)
    _decoding(scheduler)
    scheduler.add(_request("p", 30))
    assert _step(scheduler) == [("d", 1), ("p", 30)]


def test_a_step_with_no_decode_takes_every_batched_token():
    budget = Recorder(8)
    scheduler = _scheduler(budget)
    scheduler.add(_request("p", 100))
    assert [_step(scheduler) for _ in range(2)] == [[("p", 64)], [("p", 36)]]
    assert budget.asked == []  # nothing decoded: the budget is not consulted


def _admitted(scheduler: Scheduler, rid: str, length: int) -> None:
    """A PD decode worker's way in: a prompt prefilled elsewhere starts decoding at once
    (newer than every running request)."""
    request = _request(rid, length)
    assert scheduler.reserve(request) is not None
    scheduler.admit_prefilled(rid)
    request.token_ids.append(7)  # the prefill worker's first token


def test_decodes_go_first_even_behind_an_older_prompt():
    """An older prefilling request takes a step whole, oldest first; with the budget the
    decodes are picked first and the prompt gets what is left, up to the budget."""
    for budget, expected in [(None, [("p", 8)]), (Recorder(4), [("d", 1), ("p", 4)])]:
        scheduler = _scheduler(budget, max_tokens=8)
        scheduler.add(_request("p", 40))
        assert _step(scheduler) == [("p", 8)]  # alone: no decode yet
        _admitted(scheduler, "d", 3)
        assert _step(scheduler) == expected


def test_several_decodes_and_prompts_share_the_prefill_budget_oldest_first():
    budget = Recorder(10)
    scheduler = _scheduler(budget)
    _decoding(scheduler, "d1")
    _step(scheduler)
    scheduler.add(_request("d2", 6))
    assert _step(scheduler) == [("d1", 1), ("d2", 6)]
    scheduler.add(_request("p1", 7))
    scheduler.add(_request("p2", 9))
    assert _step(scheduler) == [("d1", 1), ("d2", 1), ("p1", 7), ("p2", 3)]
    assert _step(scheduler) == [("d1", 1), ("d2", 1), ("p1", 1), ("p2", 6)]  # p1 decodes
    assert budget.asked[-2:] == [2, 3]
    assert budget.burst[-2:] == [0, 0]  # every request arrived apart: no burst


def test_the_burst_is_the_prompts_that_arrived_with_the_newest_decode():
    """Prompts that arrived within the window of the newest running decode are its burst
    (their tokens still to compute go to the budget); earlier and later ones are not."""
    budget = Recorder(10)
    scheduler = _scheduler(budget, burst_window_s=0.1)
    _decoding(scheduler, "d1")
    _step(scheduler)
    (d1,) = scheduler.running
    arrivals = {"early": d1.arrival_time - 0.5, "with": d1.arrival_time + 0.05,
                "late": d1.arrival_time + 0.3}
    for rid, when in arrivals.items():
        request = _request(rid, 7)
        request.arrival_time = when
        scheduler.add(request)
    _step(scheduler)
    assert budget.burst[-1] == 7  # "with" alone


def test_a_zero_budget_still_moves_the_prompt_a_token_a_step():
    scheduler = _scheduler(Recorder(0))
    _decoding(scheduler)
    scheduler.add(_request("p", 3))
    assert [_step(scheduler) for _ in range(3)] == [[("d", 1), ("p", 1)]] * 3


def test_a_picked_decode_preempted_for_an_older_prompt_leaves_the_step():
    """Decodes are picked before prompts, so an older prompt's chunk may need the blocks of a
    decode picked a moment ago: that decode is preempted and is not in the step."""
    scheduler = _scheduler(Recorder(8), num_blocks=7, max_tokens=8, caching=False)
    scheduler.add(_request("p", 40))
    assert _step(scheduler) == [("p", 8)]  # 2 blocks
    _admitted(scheduler, "d", 3)  # 1 block; d is newer than p
    assert _step(scheduler) == [("d", 1), ("p", 7)]  # min(8 - 1, 8): 2 more blocks, 2 free
    batch = scheduler.schedule()  # d's next token takes the last free block, p needs 2
    assert [(s.request_id, len(s.token_ids)) for s in batch.seqs] == [("p", 7)]
    assert batch.preempted == ("d",) and scheduler.waiting[0].request_id == "d"
    scheduler.update(batch)
    assert scheduler.kv.stats().num_used_blocks == 6  # p's 6; d's blocks went back
