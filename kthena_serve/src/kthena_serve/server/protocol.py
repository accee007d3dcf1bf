"""OpenAI request bodies, validated strictly (a string is not a number); what the server answers
is built in responses.py (and logprobs.py).

A body field is either honoured or refused: an unknown field is a 400 (as OpenAI answers), and
fields this server does not implement (``functions`` / ``function_call``, ``suffix``,
``best_of`` > 1, ``priority`` other than 0, vLLM's removed ``guided_*``) are accepted only with
their neutral value and refused by name otherwise (``refuse_unsupported``). ``response_format``
and vLLM's ``structured_outputs`` become ``SamplingParams.structured_outputs``; chat ``tools``
are tools.py's.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kthena_serve.engine.errors import InvalidRequestError
from kthena_serve.engine.sampling_params import MAX_LOGPROBS, SamplingParams, check_num_logprobs
from kthena_serve.engine.structured_output import StructuredOutputsParams
from kthena_serve.server.tools import NamedToolChoice, Tool, ToolCall, tool_constraint

__all__ = ["ChatCompletionRequest", "CompletionRequest"]

_LOGPROB_RANGE = {"minimum": 0, "maximum": MAX_LOGPROBS}  # checked by check_num_logprobs


class _Strict(BaseModel):
    # NaN / Infinity (which Python's JSON parser reads) get "Input should be a finite number"
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def _refuse(param: str, value: Any, why: str) -> None:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise InvalidRequestError(f"{param}={shown} is not supported: {why}", param)


class StreamOptions(_Strict):
    """OpenAI's stream options (unknown keys are a 400, as everywhere)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (with include_usage)


class _Forbid(_Strict):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class JsonSchemaFormat(_Forbid):
    """OpenAI's ``response_format.json_schema``; ``strict`` is accepted either way (the
    output always follows the schema)."""

    name: str = Field(min_length=1)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Forbid):
    """``{"type": "text" | "json_object" | "json_schema" | "structural_tag", ...}`` (OpenAI's,
    and vLLM's structural tag: xgrammar's ``format``, or the legacy ``structures`` /
    ``triggers``)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        """Raises InvalidRequestError (``response_format``) for a type without its fields."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.json_schema is None:
                raise InvalidRequestError("response_format of type json_schema needs "
                                          "json_schema.schema", "response_format")
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        tag = self.model_dump(exclude_none=True, exclude={"json_schema"})
        return StructuredOutputsParams(structural_tag=tag)


class StructuredOutputs(_Forbid):
    """vLLM's ``structured_outputs`` (its ``StructuredOutputsParams``): one of ``json``,
    ``regex``, ``choice``, ``grammar``, ``json_object``, ``structural_tag``."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    # vLLM's xgrammar backend ignores both: the first is accepted (xgrammar already allows no
    # property a schema does not name, unless the schema sets additionalProperties), the
    # second refused unless null
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def constraint(self) -> StructuredOutputsParams:
        if self.whitespace_pattern is not None:
            _refuse("structured_outputs.whitespace_pattern", self.whitespace_pattern,
                    "xgrammar (vLLM's default backend too) has no whitespace pattern; use "
                    "disable_any_whitespace")
        return StructuredOutputsParams(
            json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
            json_object=self.json_object, structural_tag=self.structural_tag,
            disable_any_whitespace=self.disable_any_whitespace)


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
           "guided_decoding_backend", "guided_whitespace_pattern")


class _Common(_Strict):
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
            _refuse("priority", self.priority, "requests run first-come first-served (as "
                    "vLLM's default scheduling policy, which refuses priority too); leave it "
                    "out or send 0")
        for name in _GUIDED:
            if getattr(self, name) is not None:
                _refuse(name, getattr(self, name), "vLLM removed the guided-decoding fields "
                        "(vLLM 0.32 ignores them and does not constrain the output); use "
                        "structured_outputs (or response_format) instead")

    @property
    def include_usage(self) -> bool:
        """A final usage chunk in a stream (a JSON answer always has usage)."""
        return bool((self.stream_options and self.stream_options.include_usage)
                    or self.top_level_include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: every chunk carries its choice's usage so far."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    # a text, texts, token ids, or several prompts of token ids (vLLM's and OpenAI's four forms)
    prompt: str | list[str] | list[int] | list[list[int]] = Field(min_length=1)
    max_tokens: int | None = Field(16, ge=1)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS etc. on a text prompt
    logprobs: int | None = Field(None, json_schema_extra=_LOGPROB_RANGE)
    echo: bool = False  # the prompt before the output (with logprobs: the prompt's too)
    suffix: str | None = None  # refused unless empty
    best_of: int | None = None  # refused if over 1

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
        if self.suffix:
            _refuse("suffix", self.suffix, "there is no insertion mode; leave out suffix")
        if self.best_of is not None and self.best_of != 1:
            _refuse("best_of", self.best_of, "choices are not ranked server-side; use n for "
                    "several choices")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """A message; an assistant's may carry ``tool_calls``, a ``tool`` message answers one
    (``tool_call_id``)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
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
        legacy = "OpenAI deprecated function calling; send tools and tool_choice instead"
        if self.functions is not None:
            _refuse("functions", self.functions, legacy)
        if self.function_call not in (None, "none"):
            _refuse("function_call", self.function_call, legacy)
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
