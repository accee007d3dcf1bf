"""SamplingParams validation, the vectorised sampler, and stop handling on the text stream."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kthena_serve.engine.output_stream import OutputStream
from kthena_serve.engine.request import FinishReason, Request
from kthena_serve.engine.sampler import Sampler
from kthena_serve.engine.sampling_params import SamplingParams


def _req(rid: str, params: SamplingParams, outputs=()) -> Request:
    request = Request(rid, [1, 2, 3], params)
    request.token_ids += list(outputs)
    return request


@pytest.mark.parametrize("bad", [
    {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 0}, {"top_k": -2},
    {"max_tokens": 0}, {"max_tokens": -3}, {"presence_penalty": 3.0}, {"stop": [""]},
    {"stop_token_ids": [-1]}, {"temperature": "hot"},
])
def test_bad_params_are_refused(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_greedy_is_argmax_and_top_k_one_matches_it():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    sampler = Sampler()
    greedy = sampler(logits, [_req(str(i), SamplingParams(temperature=0)) for i in range(4)])
    assert greedy == logits.argmax(-1).tolist()
    top1 = sampler(logits, [_req(str(i), SamplingParams(temperature=1.5, top_k=1)) for i in range(4)])
    assert top1 == greedy
    tiny_p = sampler(logits, [_req(str(i), SamplingParams(top_p=1e-6)) for i in range(4)])
    assert tiny_p == greedy


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.sampled_from([100, 4096, 4100, 5000, 49152]),
       kind=st.sampled_from(["random", "bf16 ties", "few values", "-inf rows", "nan", "max in tail"]),
       seed=st.integers(0, 2**31 - 1))
def test_greedy_argmax_is_torchs_first_maximum(rows, vocab, kind, seed):
    """Both greedy argmax paths (numpy's scan for few rows, the chunked torch one) give
    max(dim=-1)'s index on fresh random logits: ties (bf16 rounding, a handful of values)
    resolved to the first, all -inf rows, NaN (counted as the maximum, as torch does), a
    maximum in the part past the last whole chunk."""
    from kthena_serve.engine.sampler import _argmax, _chunked_argmax

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    if kind == "bf16 ties":
        logits = (logits * 4).bfloat16().float()
    elif kind == "few values":
        logits = torch.randint(0, 3, (rows, vocab), generator=gen).float()
    elif kind == "-inf rows":
        logits[: max(1, rows // 2)] = -math.inf
    elif kind == "nan":
        logits[0, int(torch.randint(0, vocab, (1,), generator=gen))] = math.nan
    elif kind == "max in tail":
        logits[:, -1] = 100.0
    want = logits.max(dim=-1).indices
    assert torch.equal(_argmax(logits), want) and torch.equal(_chunked_argmax(logits), want)


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1, 0.0]]))
    sampler = Sampler()
    draws = [sampler(logits, [_req("a", SamplingParams())])[0] for _ in range(2000)]
    counts = [draws.count(i) / len(draws) for i in range(4)]
    assert abs(counts[0] - 0.7) < 0.05 and abs(counts[2] - 0.1) < 0.03 and counts[3] == 0
    top_p = [sampler(logits, [_req("b", SamplingParams(top_p=0.75))])[0] for _ in range(300)]
    assert set(top_p) == {0, 1}  # 0.7 alone is short of 0.75; 0.7 + 0.2 covers it


def test_seed_reproduces_tokens_whatever_the_batch():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=7)
    first = [Sampler()(logits[2:], [_req("s", params)])[0] for _ in range(1)]
    sampler = Sampler()
    batch = [_req("x", SamplingParams()), _req("y", SamplingParams()), _req("s", params)]
    assert sampler(logits, batch)[2] == first[0]


def test_penalties_push_away_repeated_tokens():
    logits = torch.tensor([[5.0, 4.9, 0.0]])
    sampler = Sampler()
    plain = _req("a", SamplingParams(temperature=0), outputs=[0, 0])
    penalised = _req("b", SamplingParams(temperature=0, frequency_penalty=0.5), outputs=[0, 0])
    assert sampler(logits.repeat(2, 1), [plain, penalised]) == [0, 1]
    present = _req("c", SamplingParams(temperature=0, presence_penalty=0.2), outputs=[0])
    assert sampler(logits, [present]) == [1]


class _Detok:
    """Each token id is the code point of one character."""

    def step(self, token_id: int) -> str:
        return chr(token_id)


def _stream(params: SamplingParams, eos=(0,), max_tokens=100) -> OutputStream:
    return OutputStream(_Detok(), params, eos, max_tokens)


def test_stop_string_is_cut_and_never_streamed():
    stream = _stream(SamplingParams(stop=["END", "!!"]))
    sent = ""
    for ch in "hello EN":
        assert stream.append(ord(ch)) is None
        sent += stream.take_new_text(False)
    assert sent == "hello "  # "EN" held back: it may start "END"
    assert stream.append(ord("D")) is FinishReason.STOP
    assert stream.text == "hello "
    assert sent + stream.take_new_text(True) == "hello "


def test_eos_stop_ids_and_length():
    stream = _stream(SamplingParams(stop_token_ids=[5]), max_tokens=3)
    assert stream.append(ord("a")) is None
    assert stream.append(5) is FinishReason.STOP
    assert _stream(SamplingParams()).append(0) is FinishReason.STOP
    assert _stream(SamplingParams(ignore_eos=True)).append(0) is None
    stream = _stream(SamplingParams(), max_tokens=2)
    assert stream.append(ord("a")) is None and stream.append(ord("b")) is FinishReason.LENGTH
    assert stream.take_new_text(True) == "ab"


def test_chinese_text_streams_as_whole_characters():
    from _tiny import default_tokenizer

    from kthena_serve.model import IncrementalDetokenizer

    tokenizer = default_tokenizer()
    text = "长城是中国古代的军事防御工程。Hello, 世界！"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text) // 2  # several tokens per character: the case that breaks
    stream = OutputStream(IncrementalDetokenizer(tokenizer, []), SamplingParams(), (), 1000)
    pieces = []
    for token_id in ids:
        stream.append(token_id)
        pieces.append(stream.take_new_text(False))
    pieces.append(stream.take_new_text(True))
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == text


# ---- repetition_penalty and min_p (vLLM's sampling fields) ---------------------------------------
@pytest.mark.parametrize("bad", [{"repetition_penalty": 0.0}, {"repetition_penalty": -1.0},
                                 {"repetition_penalty": float("nan")}, {"min_p": -0.1},
                                 {"min_p": 1.5}, {"min_p": float("inf")}])
def test_bad_vllm_sampling_values_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), penalty=st.floats(0.5, 3.0),
       num_prompt=st.integers(1, 12), num_output=st.integers(0, 8))
def test_repetition_penalty_matches_a_float64_reference(seed, penalty, num_prompt, num_output):
    """Every token of the prompt and the output: logit / penalty when positive, x penalty
    otherwise; the rest untouched. One correctly rounded fp32 division or product per logit,
    so the result is within 1 ulp of the float64 reference (rtol 2**-23)."""
    from kthena_serve.engine.sampler import _apply_penalties

    gen = torch.Generator().manual_seed(seed)
    vocab = 64
    logits = torch.randn(1, vocab, generator=gen) * 4
    ids = torch.randint(0, vocab, (num_prompt + num_output,), generator=gen).tolist()
    request = Request("r", ids[:num_prompt], SamplingParams(repetition_penalty=penalty))
    request.token_ids += ids[num_prompt:]
    got = _apply_penalties(logits, [request])[0]
    expected = logits[0].double().clone()
    for token in set(ids):
        x = expected[token]
        expected[token] = x / penalty if x > 0 else x * penalty
    torch.testing.assert_close(got.double(), expected, rtol=2**-23, atol=0.0)
    assert torch.equal(logits, logits.clone())  # the caller's logits are not modified


def test_repetition_penalty_one_is_off_and_greedy_follows_the_penalised_argmax():
    logits = torch.tensor([[5.0, 4.9, -1.0, 0.5]])
    sampler = Sampler()
    assert not SamplingParams(repetition_penalty=1.0).has_penalties
    plain = _req("a", SamplingParams(temperature=0, repetition_penalty=1.0))
    assert sampler(logits, [plain]) == [0]
    request = Request("b", [0], SamplingParams(temperature=0, repetition_penalty=1.1))
    assert sampler(logits, [request]) == [1]  # 5.0 / 1.1 < 4.9: token 0 (in the prompt) loses


def test_min_p_draws_only_tokens_above_its_floor():
    """min_p=0.2 after temperature: a token is drawn only if its probability is at least 0.2 x
    the top one's; without min_p the many small tokens (half the mass) are drawn too."""
    logits = torch.full((1, 101), 0.0)
    logits[0, 0] = math.log(50.0)  # p(top) = 50 / 150; each of the 100 others 1 / 150
    logits[0, 1] = math.log(20.0)  # above the floor: 20 >= 0.2 x 50
    sampler = Sampler()
    with_min_p = {sampler(logits, [_req(f"m{i}", SamplingParams(min_p=0.2, seed=i))])[0]
                  for i in range(200)}
    assert with_min_p == {0, 1}
    without = {sampler(logits, [_req(f"n{i}", SamplingParams(seed=i))])[0] for i in range(200)}
    assert len(without - {0, 1}) > 10


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    """vLLM's rule: the token sampled now is number len(output) + 1; EOS and stop_token_ids
    are masked while the output is shorter than min_tokens, allowed after."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, 0.0, 9.0, 0.0, 8.0]])  # EOS 5 best, stop 7 next
    sampler = Sampler(eos_token_ids=[5])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[7], max_tokens=8)
    assert sampler(logits, [_req("a", params)]) == [2]  # neither 5 nor 7: the next best
    assert sampler(logits, [_req("b", params, outputs=[3])]) == [2]  # one token so far
    assert sampler(logits, [_req("c", params, outputs=[3, 3])]) == [5]  # two: stops allowed
    free = attrs.evolve(params, ignore_eos=True)  # EOS is no stop then; stop ids still are
    assert sampler(logits, [_req("d", free)]) == [5]
    assert Sampler()(logits, [_req("e", SamplingParams(temperature=0, min_tokens=3))]) == [5]


def test_no_stop_ends_the_output_before_min_tokens():
    params = SamplingParams(stop=["b"], stop_token_ids=[9], min_tokens=3)
    stream = _stream(params)
    assert [stream.append(t) for t in (ord("b"), 9)] == [None, None]  # text "b" + chr(9)
    assert stream.append(ord("b")) is FinishReason.STOP  # the third token may stop
    assert stream.text == "b\t"


@pytest.mark.parametrize("bad", [{"min_tokens": -1}, {"min_tokens": 1.5},
                                 {"min_tokens": 5, "max_tokens": 4}])
def test_bad_min_tokens_are_refused(bad):
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(**bad)
