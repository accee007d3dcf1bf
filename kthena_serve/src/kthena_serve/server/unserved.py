"""vLLM's request fields this server does not serve, and what a value of each gets.

``UNSERVED`` holds the fields both of vLLM's requests declare (and OpenAI fields vLLM ignores
with a warning), ``CHAT_UNSERVED`` and ``COMPLETION_UNSERVED`` those of one request. A neutral
value is accepted; another is refused by name where it would change the answer, else ignored
with a logged warning (protocol.py's ``ignored_fields``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["CHAT_UNSERVED", "COMPLETION_UNSERVED", "UNSERVED", "Unserved"]


@attrs.frozen
class Unserved:
    """A request field vLLM declares (or an OpenAI one vLLM ignores) that is not served here.

    Attributes:
        is_neutral: whether a value (given the whole body) changes nothing; it is then accepted.
        refused: another value is a 400 naming the field (it would change the answer), or else
            ignored with a logged warning (it would not).
        why: the reason, in the 400 or the warning (with what to send instead).
    """

    is_neutral: Callable[[Any, Any], bool]
    refused: bool
    why: str


def _empty(value: Any, _body: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


def _equals(neutral: Any) -> Callable[[Any, Any], bool]:
    return lambda value, _body: value == neutral


def _refused(why: str, is_neutral: Callable[[Any, Any], bool] = _empty) -> Unserved:
    return Unserved(is_neutral, True, why)


def _ignored(why: str, is_neutral: Callable[[Any, Any], bool] = _empty) -> Unserved:
    return Unserved(is_neutral, False, why)


# vLLM's CompletionRequest and ChatCompletionRequest fields (both declare these) not served here
UNSERVED: dict[str, Unserved] = {
    "use_beam_search": _refused("there is no beam search here; sample several choices with n, "
                                "or send false"),
    "watermarking": _refused("there is no output watermarking here; send false or leave it out"),
    "truncation_side": _refused(
        "truncate_prompt_tokens keeps the prompt's last tokens (the left side is cut, vLLM's "
        "default); send left or leave it out",
        lambda value, body: value != "right" or body.truncate_prompt_tokens is None),
    "logprob_token_ids": _refused("logprobs of chosen token ids are not served; use logprobs "
                                  "(the top tokens) instead"),
    "vllm_xargs": _refused("no custom extension runs here to read them (vLLM passes them to its "
                           "plugins); send {} or leave it out"),
    "repetition_detection": _refused("there is no repetition detection here, so generation "
                                     "would not stop where vLLM stops it; use stop, bad_words "
                                     "or max_tokens"),
    "thinking_token_budget": _refused(
        "there is no reasoning parser here, so no thinking section to budget; send -1 or leave "
        "it out", lambda value, _body: value is None or value == -1),
    "length_penalty": _ignored("it weighs beam-search scores only (vLLM applies it to nothing "
                               "else), and there is no beam search here",
                               _equals(1.0)),
    "session_id": _ignored("requests keep no session state here (prefix caching finds a shared "
                           "prompt without it)"),
    "routed_experts_prompt_start": _ignored("no routed-expert data is returned here",
                                            _equals(0)),
    "return_token_offsets": _ignored("vLLM returns token offsets only from its /render "
                                     "endpoints, and ignores it on generation too"),
    "return_mm_kwargs": _ignored("vLLM reads it only on its /render endpoints", _equals(True)),
    "ec_transfer_params": _ignored("text-only models: there is no encoder cache to transfer"),
    "stream_interval": _ignored("each streamed chunk carries what one engine step made; the "
                                "text is the same"),
    # OpenAI's fields that vLLM does not declare (it ignores them with a warning)
    "service_tier": _ignored("there is one service tier here",
                             lambda value, _body: value in (None, "auto", "default")),
    "metadata": _ignored("nothing is stored here to tag"),
    "safety_identifier": _ignored("OpenAI's abuse-monitoring id, like user: it changes no "
                                  "output"),
    "prompt_cache_key": _ignored("prefix caching here matches prompts by their tokens "
                                 "(cache_salt keys it)"),
}

# ... and those only vLLM's ChatCompletionRequest declares (documents, reasoning_effort and
# echo are honoured: see ChatCompletionRequest)
CHAT_UNSERVED: dict[str, Unserved] = {
    "chat_template": _refused("the checkpoint's chat template renders every request; leave it "
                              "out"),
    "return_prompt_text": _refused("the rendered prompt is not returned; POST /tokenize with "
                                   "the messages gives its tokens"),
    "include_reasoning": _ignored("there is no reasoning parser here: no reasoning is split "
                                  "from the content to leave out", _equals(True)),
    "media_io_kwargs": _ignored("text-only models: there is no media to load"),
    "mm_processor_kwargs": _ignored("text-only models: there is no multimodal processor"),
}

COMPLETION_UNSERVED: dict[str, Unserved] = {
    "prompt_embeds": _refused("prompts are text or token ids here; send prompt"),
}
