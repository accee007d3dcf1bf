"""OpenAI request bodies, validated strictly (a string is not a number); what the server answers
is built in responses.py (and logprobs.py).

A body field is either honoured or refused: an unknown field is a 400 (as OpenAI answers), and
fields this server does not implement (``functions`` / ``function_call``, ``suffix``,
``best_of`` > 1, ``priority`` other than 0, vLLM's removed ``guided_*``) are accepted only with
their neutral value and refused by name otherwise (``refuse_unsupported``). The other fields
vLLM's two requests declare, and OpenAI fields vLLM ignores with a warning, are in
``UNSERVED`` (unserved.py): a neutral value is accepted; another is refused by name where it would change the
answer, else ignored with a logged warning (``ignored_fields``). ``response_format`` and
vLLM's ``structured_outputs`` become ``SamplingParams.structured_outputs``; chat ``tools`` are
tools.py's.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from kthena_serve.engine.errors import InvalidRequestError
from kthena_serve.engine.sampling_params import MAX_LOGPROBS, SamplingParams, check_num_logprobs
from kthena_serve.engine.schema_check import check_json_schema
from kthena_serve.engine.structured_output import StructuredOutputsParams
from kthena_serve.server.request_parts import (
    ResponseFormat,
    StreamOptions,
    Strict,
    StructuredOutputs,
    refuse,
)
from kthena_serve.server.tools import NamedToolChoice, Tool, ToolCall, tool_constraint
from kthena_serve.server.unserved import CHAT_UNSERVED, COMPLETION_UNSERVED, UNSERVED, Unserved

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "RequestCommon", "TextPart"]

_LOGPROB_RANGE = {"minimum": 0, "maximum": MAX_LOGPROBS}  # checked by check_num_logprobs


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
           "guided_decoding_backend", "guided_whitespace_pattern")


class RequestCommon(Strict):
    """Fields both endpoints share; ``prefix_hash`` / ``reuse_offset`` are hints, never trusted.

    ``user`` is OpenAI's end-user id for abuse monitoring: accepted, it changes no output.
    """

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    model: str | None = None  # vLLM's: optional, the served model when left out
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)  # vLLM's; 1.0 (what its clients send): off
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # vLLM's; 0: off
    min_tokens: int = Field(0, ge=0)  # vLLM's: no stop before this many tokens
    ignore_eos: bool = False
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    prefix_hash: str | None = Field(None, max_length=256)
    reuse_offset: int | None = Field(None, ge=0)
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # OpenAI's: {token id: bias}, clamped to +-100
    # vLLM's extensions (its names, defaults and meanings)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    return_tokens_as_token_ids: bool = False
    priority: int = 0  # refused unless 0: first-come first-served (vLLM's default policy)
    request_id: str | None = Field(None, min_length=1, max_length=256)
    prompt_logprobs: int | None = Field(None, json_schema_extra=_LOGPROB_RANGE)
    # The Kthena router's PD connectors: where the prompt's KV is (PD workers only; a server
    # without a KV connector refuses it), and usage asked for at the top level of a body.
    kv_transfer_params: dict[str, Any] | None = None
    top_level_include_usage: bool | None = Field(None, alias="include_usage")
    # Structured output: OpenAI's response_format (it wins, as in vLLM), vLLM's
    # structured_outputs, and the guided_* fields vLLM 0.32 removed (refused here)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    # vLLM's: each choice's token ids (and its prompt's) in the answer
    return_token_ids: bool | None = None
    # Not served (UNSERVED: which values are neutral, refused or ignored), vLLM's types
    use_beam_search: bool = False
    watermarking: bool | None = None
    truncation_side: Literal["left", "right"] | None = None
    logprob_token_ids: list[int] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    length_penalty: float = 1.0
    session_id: str | None = None
    routed_experts_prompt_start: int = Field(0, ge=0)
    return_token_offsets: bool | None = None
    return_mm_kwargs: bool = True
    ec_transfer_params: dict[str, Any] | None = None
    stream_interval: int | None = Field(None, ge=1)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    unserved: ClassVar[dict[str, Unserved]] = UNSERVED

    def output_constraint(self) -> StructuredOutputsParams | None:
        """What the output must follow: ``response_format`` (not text), else
        ``structured_outputs``, else None. Raises InvalidRequestError naming the field."""
        if self.response_format is not None and self.response_format.type != "text":
            return self.response_format.constraint()
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        return None

    def constraint_param(self) -> str:
        """The body field the output constraint came from (compile errors name it)."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        return "structured_outputs"

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        """Raises ValueError (from SamplingParams, or InvalidRequestError naming the field) for
        what pydantic cannot see."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids or (),
            ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_p=self.min_p,
            min_tokens=self.min_tokens,
            logprobs=self.num_logprobs(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or (), truncate_prompt_tokens=self.truncate_prompt_tokens,
            prompt_logprobs=self.num_prompt_logprobs(),
            structured_outputs=self.output_constraint(),
        )

    def num_logprobs(self) -> int | None:
        """Top alternatives per token the caller asked for (None: no logprobs)."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        """Top alternatives per prompt token to compute (None: none)."""
        return self.prompt_logprobs

    def refuse_unsupported(self) -> None:
        """Raise InvalidRequestError naming the first field set to what is not implemented."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed with stream: true (as "
                                      "vLLM answers)", "stream_options")
        if self.continuous_usage and not self.include_usage:
            # vLLM ignores it then; a key that does nothing is refused here
            raise InvalidRequestError("stream_options.continuous_usage_stats needs "
                                      "stream_options.include_usage: true (usage in every "
                                      "chunk is part of the stream's usage); send both or "
                                      "leave it out", "stream_options.continuous_usage_stats")
        if self.priority != 0:
            refuse("priority", self.priority, "requests run first-come first-served (as "
                    "vLLM's default scheduling policy, which refuses priority too); leave it "
                    "out or send 0")
        for name in _GUIDED:
            if getattr(self, name) is not None:
                refuse(name, getattr(self, name), "vLLM removed the guided-decoding fields "
                        "(vLLM 0.32 ignores them and does not constrain the output); use "
                        "structured_outputs (or response_format) instead")
        for name, field in self.unserved.items():
            value = getattr(self, name)
            if field.refused and not field.is_neutral(value, self):
                refuse(name, value, field.why)

    def ignored_fields(self) -> list[tuple[str, Any, str]]:
        """``(name, value, why)`` of each field set to a value this server ignores (the caller
        logs a warning, as vLLM does for the fields it ignores)."""
        return [(name, getattr(self, name), field.why) for name, field in self.unserved.items()
                if not field.refused and not field.is_neutral(getattr(self, name), self)]

    @property
    def include_usage(self) -> bool:
        """A final usage chunk in a stream (a JSON answer always has usage)."""
        return bool((self.stream_options and self.stream_options.include_usage)
                    or self.top_level_include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: every chunk carries its choice's usage so far."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(RequestCommon):
    # a text, texts, token ids, or several prompts of token ids (vLLM's and OpenAI's four forms)
    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo (is_echo_only)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS etc. on a text prompt
    logprobs: int | None = Field(None, json_schema_extra=_LOGPROB_RANGE)
    echo: bool = False  # the prompt before the output (with logprobs: the prompt's too)
    suffix: str | None = None  # refused unless empty
    best_of: int | None = None  # refused if over 1
    prompt_embeds: str | list[str] | None = None  # vLLM's (base64 tensors): refused

    unserved: ClassVar[dict[str, Unserved]] = {**UNSERVED, **COMPLETION_UNSERVED}

    @property
    def is_echo_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt (and its logprobs) back, nothing
        generated (vLLM's scoring path: it runs one token and drops it, as the routes do)."""
        return self.echo and self.max_tokens == 0

    @property
    def max_tokens_to_run(self) -> int | None:
        """The engine's ``max_tokens``: 1 for `is_echo_only` (its token is not answered)."""
        return 1 if self.is_echo_only else self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """``prompt_logprobs``, or with ``echo`` and ``logprobs`` at least ``logprobs`` (the
        echoed prompt's logprobs: what lm-eval's loglikelihood tasks read)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens=0 generates nothing: it is allowed only with "
                                      "echo: true (the prompt back, with logprobs its "
                                      "logprobs, as vLLM answers); ask for at least 1 token "
                                      "or send echo: true", "max_tokens")
        if self.max_tokens == 0 and self.min_tokens:
            raise InvalidRequestError(f"min_tokens={self.min_tokens} exceeds max_tokens=0; "
                                      "send 0 or leave it out", "min_tokens")
        if self.suffix:
            refuse("suffix", self.suffix, "there is no insertion mode; leave out suffix")
        if self.best_of is not None and self.best_of != 1:
            refuse("best_of", self.best_of, "choices are not ranked server-side; use n for "
                    "several choices")


class TextPart(Strict):
    type: Literal["text"]
    text: str


class UnservedPart(Strict):
    """A content part of another type (``image_url``, ``input_audio``, ``file`` ...): parsed
    so that the request is refused naming it (``refuse_parts``), not with a schema error."""

    type: str


def _part_kind(part: Any) -> str:
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return "text" if kind == "text" else "other"


ContentPart = Annotated[Annotated[TextPart, Tag("text")] | Annotated[UnservedPart, Tag("other")],
                        Discriminator(_part_kind)]


class ChatMessage(Strict):
    """A message; an assistant's may carry ``tool_calls``, a ``tool`` message answers one
    (``tool_call_id``)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""

    def refuse_parts(self, index: int) -> None:
        """Raise InvalidRequestError naming the first content part that is not text (this
        server serves text-only models: no image, audio or file input)."""
        for j, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if isinstance(part, UnservedPart):
                raise InvalidRequestError(
                    f"messages[{index}].content[{j}] has type {part.type!r}, which this "
                    "server does not serve: it serves text-only models (no image, audio or "
                    "file input); a content part must have type 'text' ({\"type\": \"text\", "
                    "\"text\": ...}), or send content as a string",
                    f"messages.{index}.content.{j}.type")


class ChatCompletionRequest(RequestCommon):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, json_schema_extra=_LOGPROB_RANGE)
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None  # none / auto / required / a function
    parallel_tool_calls: bool | None = None  # OpenAI's default true; false: one call at most
    # OpenAI's deprecated function calling: neutral values only
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM's chat extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes them
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # the last message before the answer when it has the answer's role
    # template variables where the chat template reads them (template_variables)
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh",
                              "max"] | None = None
    # not served (CHAT_UNSERVED)
    chat_template: str | None = None
    return_prompt_text: bool | None = None
    include_reasoning: bool = True
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    unserved: ClassVar[dict[str, Unserved]] = {**UNSERVED, **CHAT_UNSERVED}

    def template_variables(self, template_reads: frozenset[str],
                           ) -> tuple[dict[str, Any], list[tuple[str, Any, str]]]:
        """vLLM's ``documents`` and ``reasoning_effort`` as chat-template variables, as vLLM
        renders them: ``reasoning_effort`` also sets ``enable_thinking`` (false for none)
        unless ``chat_template_kwargs`` does.

        Args:
            template_reads: the variables the model's chat template reads.

        Returns:
            (the variables it reads, ``(name, value, why)`` of each field it reads none of:
            ignored, which the caller logs; vLLM's renderer drops them too).
        """
        offered: list[tuple[str, Any, dict[str, Any]]] = []
        if self.documents is not None:
            offered.append(("documents", self.documents, {"documents": self.documents}))
        if self.reasoning_effort is not None:
            names: dict[str, Any] = {"reasoning_effort": self.reasoning_effort}
            if "enable_thinking" not in (self.chat_template_kwargs or {}):
                names["enable_thinking"] = self.reasoning_effort != "none"
            offered.append(("reasoning_effort", self.reasoning_effort, names))
        variables: dict[str, Any] = {}
        ignored: list[tuple[str, Any, str]] = []
        for field, value, names in offered:
            read = {k: v for k, v in names.items() if k in template_reads}
            variables.update(read)
            if not read:
                ignored.append((field, value, "this model's chat template reads no "
                                f"{' or '.join(names)} variable: it changes no output"))
        return variables, ignored

    def echo_text(self) -> str:
        """What vLLM's chat ``echo`` puts before each answer: the last message's text if its
        role is the answer's (the assistant's after a generation prompt, else the last
        message's own role), else nothing."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.role != "assistant"):
            return ""
        return last.text()

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise InvalidRequestError(f"top_logprobs={self.top_logprobs!r} needs logprobs: "
                                          "true", "top_logprobs")
            return None
        check_num_logprobs(self.top_logprobs, "top_logprobs")
        return self.top_logprobs or 0

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice``, defaulting to ``auto`` with tools and ``none`` without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the output is parsed for tool calls (tools, and a choice but none)."""
        return bool(self.tools) and self.effective_tool_choice != "none"

    def output_constraint(self) -> StructuredOutputsParams | None:
        """A ``required`` tool choice constrains the output to calls (one unless
        ``parallel_tool_calls``), a named one to one call; otherwise as for completions."""
        tools = tool_constraint(self.tools or (), self.effective_tool_choice,
                                self.parallel_tool_calls is not False)
        return tools if tools is not None else super().output_constraint()

    def constraint_param(self) -> str:
        if tool_constraint(self.tools or (), self.effective_tool_choice) is not None:
            return "tools"
        return super().constraint_param()

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for i, message in enumerate(self.messages):
            message.refuse_parts(i)
        legacy = "OpenAI deprecated function calling; send tools and tool_choice instead"
        if self.functions is not None:
            refuse("functions", self.functions, legacy)
        if self.function_call not in (None, "none"):
            refuse("function_call", self.function_call, legacy)
        self._check_tools()
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt are "
                                      "both true: continuing the last message opens no new "
                                      "turn; set add_generation_prompt to false",
                                      "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise InvalidRequestError("continue_final_message needs the last message to be "
                                      f"the assistant's (it is {self.messages[-1].role!r})",
                                      "continue_final_message")

    def _check_tools(self) -> None:
        """vLLM's rules for ``tools`` and ``tool_choice`` (its messages)."""
        if self.tools == []:
            raise InvalidRequestError("`tools` must not be an empty array. Either provide at "
                                      "least one tool or omit the field entirely.", "tools")
        if self.effective_tool_choice != "none":
            for i, tool in enumerate(self.tools or ()):  # auto compiles none: checked here
                if tool.function.parameters is not None:
                    check_json_schema(tool.function.parameters,
                                      f"tools[{i}].function.parameters",
                                      f"tool {tool.function.name!r}: its parameters schema")
        choice = self.tool_choice
        if choice is None or choice == "none":
            return
        if self.tools is None:
            raise InvalidRequestError("When using `tool_choice`, `tools` must be set.",
                                      "tool_choice")
        if isinstance(choice, str) and choice not in ("auto", "required"):
            raise InvalidRequestError(f"Invalid value for `tool_choice`: {choice}! Only named "
                                      'tools, "none", "auto" or "required" are supported.',
                                      "tool_choice")
        names = {t.function.name for t in self.tools}
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidRequestError("The tool specified in `tool_choice` does not match any "
                                      "of the specified `tools`", "tool_choice")
        constrained = choice == "required" or isinstance(choice, NamedToolChoice)
        if constrained and super().output_constraint() is not None:
            raise InvalidRequestError("You can only either use constraints for structured "
                                      "outputs or tools, not both.", "tool_choice")

    def plain_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
