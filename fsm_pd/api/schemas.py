"""Request bodies of the serving API, as pydantic models so the OpenAPI schema says what each route accepts.

Unknown fields are ignored, not refused: sglang-router re-serialises every request with its own defaults
(``log_metrics``, ``return_bytes``, ``skip_special_tokens``, ...), and OpenAI clients send fields we do not use.
Every field declared here is read: either served, or (structured output, tools, top
alternatives, ...) answered with a 400 that names it when it holds anything but its neutral value (``api.requests``;
``tests/unit/test_api_schema_fields.py`` fails on a field nobody reads). Every number is range-checked here or by
``SamplingParams`` before a request can reach a batch; NaN and Infinity are refused (``allow_inf_nan=False``, and
before that by ``api.strict_json``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fsm_pd.model.sampling_params import MAX_SEED, MAX_TOP_K
from fsm_pd.store.limits import MAX_ROOM

StopField = str | list[str] | None
MAX_N = 16  # completions per prompt (n, best_of): each is a request of its own in the engine
MAX_BATCH = 64  # prompts in one batched request
MAX_TOOLS = 128  # functions offered in one chat request
LogitBias = dict[str, float] | None  # token id (as OpenAI's JSON keys are strings) -> added to its logit


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class SGLangSamplingParams(_Body):
    temperature: float | None = Field(None, ge=0, description="0 is greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K, description="0 or -1 keeps every token")
    min_p: float | None = Field(None, ge=0, le=1)
    max_new_tokens: int | None = Field(None, ge=0, description="0: the prompt only (its logprobs), no output")
    stop: StopField = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED,
                             description="fsm-pd extension; SGLang's name sampling_seed is also read")
    sampling_seed: int | None = Field(None, ge=0, le=MAX_SEED)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    logit_bias: LogitBias = None
    no_stop_trim: bool | None = None
    # not served (yet): a 400 names them unless neutral
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    min_new_tokens: int | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None


class ResumeField(_Body):
    """Internal, sent by the fsm-pd router only (``router/migrate.py``): continue a stream whose decode node failed
    (read by ``requests.py``)."""

    output_ids: list[int] = Field(..., description="the tokens the stream generated before it broke off")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="the request's resolved seed on the failed node")


class RouteField(_Body):
    """Internal, sent by the fsm-pd router only (``router/policy.py``): the path it chose for this request and why.
    ``local`` goes to a decode node alone, with ``bootstrap_room`` and no bootstrap host: that node prefills the
    prompt itself. ``pd`` comes with the usual bootstrap fields; the decode node journals the reason."""

    path: Literal["pd", "local"]
    reason: str = Field("", max_length=500)


class GenerateBody(_Body):
    """SGLang's ``/generate``: one prompt as ``text`` or ``input_ids``, or a batch as a list of either."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SGLangSamplingParams | None = None
    stream: bool = False
    return_logprob: bool = False
    rid: str | None = Field(None, min_length=1, max_length=256)
    model: str | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    bootstrap_room: int | None = Field(None, ge=0, le=MAX_ROOM)
    fsm_pd_resume: ResumeField | None = None
    fsm_pd_route: RouteField | None = None
    # not served (yet): a 400 names them unless neutral
    top_logprobs_num: int | None = None
    logprob_start_len: int | None = None
    return_text_in_logprobs: bool | None = None
    lora_path: str | None = None
    image_data: Any = None
    return_hidden_states: bool | None = None
    custom_logit_processor: str | None = None


class FunctionDef(_Body):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: ChosenFunction


class _OpenAIBody(_Body):
    """What OpenAI's completions and chat completions bodies share, plus SGLang's PD fields."""

    model: str | None = None
    rid: str | None = Field(None, min_length=1, max_length=256, description="SGLang's request id (for /abort_request)")
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0, le=1)
    stop: StopField = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # SGLang's extension
    logit_bias: LogitBias = None
    no_stop_trim: bool | None = None  # SGLang's extension
    user: str | None = None  # accepted and not used: OpenAI's end-user id for abuse monitoring
    # not served (yet): a 400 names them unless neutral
    response_format: dict[str, Any] | None = None
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)  # chat only (completions: a 400)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    skip_special_tokens: bool | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    bootstrap_room: int | None = Field(None, ge=0, le=MAX_ROOM)
    fsm_pd_resume: ResumeField | None = None
    fsm_pd_route: RouteField | None = None


class CompletionBody(_OpenAIBody):
    prompt: str | list[int] | list[str] | list[list[int]]  # one prompt, or a batch (a list of prompts)
    max_tokens: int | None = Field(None, ge=0, description="default 16, as OpenAI; 0 with echo: the prompt only")
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    echo: bool | None = None
    suffix: str | None = None  # not served: a 400 unless empty


class TextPart(_Body):
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls, given back to the template
    tool_call_id: str | None = None  # a tool's answer: which call it answers
    name: str | None = None


class ChatCompletionBody(_OpenAIBody):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=0, description="default: what is left of the context")
    max_completion_tokens: int | None = Field(None, ge=0,
                                              description="OpenAI's newer name; sglang-router sends this one")
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None


class AbortBody(_Body):
    rid: str = ""
    # fsm-pd's: on a PD node, abort only the attempt of ``rid`` in this bootstrap room (the built-in router sends it)
    room: int | None = Field(None, ge=0, le=MAX_ROOM)
    abort_all: bool = False


class TokenizeBody(_Body):
    """SGLang's ``/tokenize``: one text or a list of texts."""

    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool | None = None  # default true


class DetokenizeBody(_Body):
    """SGLang's ``/detokenize``: one list of ids or a list of them."""

    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool | None = None  # default true
