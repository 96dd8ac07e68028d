"""Request bodies to ``GenerateRequest``s: tokenising, sampling parameters, PD bootstrap fields, and every check that
turns a bad request into a 400/404 before the engine sees it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from fsm_pd.api.chat_template import render_messages
from fsm_pd.api.errors import ApiError
from fsm_pd.api.schemas import ChatCompletionBody, CompletionBody, GenerateBody, SGLangSamplingParams
from fsm_pd.engine.sampling import SamplingParams
from fsm_pd.serving.types import Bootstrap, GenerateRequest

GENERATE_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default for /generate
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and SGLang's) default for /v1/completions
PD_ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class NodeIdentity:
    """What a request is checked against: the engine's role and context, the names it answers to."""

    role: str
    max_context: int
    model_names: frozenset[str]
    bootstrap_port: int | None  # this node's bootstrap port: the default for a request with bootstrap_port null
    vocab_size: int | None = None  # the model's vocabulary (token ids the model embeds), not the tokenizer's size


def new_rid() -> str:
    return uuid.uuid4().hex


def check_model(node: NodeIdentity, model: str | None) -> None:
    if model is not None and model not in node.model_names:
        served = ", ".join(sorted(node.model_names))
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served}", code="model_not_found")


def resolve_bootstrap(node: NodeIdentity, host: str | None, port: int | None, room: int | None) -> Bootstrap | None:
    """SGLang's PD fields. A colocated node ignores them; a prefill/decode node needs host and room, and takes
    its own bootstrap port when the router sent ``bootstrap_port: null`` (as SGLang's decode does)."""
    if node.role not in PD_ROLES:
        return None
    port = port if port is not None else node.bootstrap_port
    if host is None or room is None or port is None:
        missing = [n for n, v in (("bootstrap_host", host), ("bootstrap_port", port), ("bootstrap_room", room))
                   if v is None]
        raise ApiError(400, f"a {node.role} node serves only requests routed by a PD router: missing "
                            f"{', '.join(missing)}")
    if not host:
        raise ApiError(400, "bootstrap_host must be a non-empty host name")
    return Bootstrap(host=host, port=port, room=room)


def choose_seed(seed: int | None, bootstrap: Bootstrap | None, params: SamplingParams) -> int:
    """An explicit seed wins. Without one, a PD request takes its seed from the room: the prefill and decode nodes
    get the same body from the router and must sample with the same seed, and the room is what they share."""
    if seed is not None:
        return seed
    if bootstrap is not None:
        return bootstrap.room & 0x7FFFFFFF
    return params.resolved_seed()


def make_sampling(*, temperature, top_p, top_k, max_new_tokens, stop, stop_token_ids, ignore_eos,
                  seed) -> SamplingParams:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    try:
        return SamplingParams(
            temperature=1.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            top_k=0 if top_k is None or top_k < 0 else int(top_k),  # SGLang's -1 means "all", as our 0 does
            max_new_tokens=max_new_tokens,
            stop=stops,
            stop_token_ids=tuple(stop_token_ids or ()),
            ignore_eos=bool(ignore_eos),
            seed=seed,
        )
    except ValueError as err:
        raise ApiError(400, str(err)) from err


def refuse_unsupported(**values) -> None:
    """Fields fsm-pd does not implement: accepted at their neutral value (the router sends them), refused otherwise."""
    neutral = {"n": 1, "best_of": 1, "echo": False, "frequency_penalty": 0.0, "presence_penalty": 0.0,
               "repetition_penalty": 1.0, "min_p": 0.0}
    for name, value in values.items():
        if value is not None and value != neutral[name]:
            raise ApiError(400, f"{name}={value!r} is not supported by fsm-pd (only {neutral[name]!r})")


def check_lengths(node: NodeIdentity, input_ids: list[int], max_new_tokens: int | None) -> int:
    """Checks the prompt and the token budget against the context; returns max_new_tokens (filled in when None)."""
    if not input_ids:
        raise ApiError(400, "the prompt is empty")
    if len(input_ids) >= node.max_context:
        raise ApiError(400, f"the prompt has {len(input_ids)} tokens; this model's context is {node.max_context} "
                            f"tokens (prompt and output together)")
    room = node.max_context - len(input_ids)
    if max_new_tokens is None:
        return room
    if max_new_tokens < 1:
        raise ApiError(400, f"max tokens must be at least 1, got {max_new_tokens}")
    if max_new_tokens > room:
        raise ApiError(400, f"{len(input_ids)} prompt tokens + {max_new_tokens} new tokens exceed this model's "
                            f"context of {node.max_context} tokens")
    return max_new_tokens


def check_token_ids(node: NodeIdentity, ids: list[int], what: str) -> None:
    """Ids must be ones the model can embed: its own output (the model's vocabulary can be larger than the
    tokenizer's, e.g. padded to a multiple of 64) is a valid prompt."""
    vocab = node.vocab_size
    bad = [i for i in ids if i < 0 or (vocab is not None and i >= vocab)]
    if bad:
        raise ApiError(400, f"{what} holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}")


def from_generate(node: NodeIdentity, tokenizer, body: GenerateBody) -> GenerateRequest:
    check_model(node, body.model)
    if isinstance(body.text, list) or (body.input_ids and isinstance(body.input_ids[0], list)):
        raise ApiError(400, "batched /generate (a list of prompts) is not supported; send one request per prompt")
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "give exactly one of text or input_ids")
    if body.input_ids is not None:
        input_ids = list(body.input_ids)
        check_token_ids(node, input_ids, "input_ids")
    else:
        input_ids = tokenizer.encode(body.text)
    sp = body.sampling_params or SGLangSamplingParams()
    refuse_unsupported(n=sp.n, frequency_penalty=sp.frequency_penalty, presence_penalty=sp.presence_penalty,
                       repetition_penalty=sp.repetition_penalty, min_p=sp.min_p)
    max_new = sp.max_new_tokens if sp.max_new_tokens is not None else GENERATE_DEFAULT_MAX_NEW_TOKENS
    max_new = check_lengths(node, input_ids, max_new)
    seed = sp.seed if sp.seed is not None else sp.sampling_seed
    sampling = make_sampling(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, max_new_tokens=max_new,
                             stop=sp.stop, stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos, seed=seed)
    bootstrap = resolve_bootstrap(node, body.bootstrap_host, body.bootstrap_port, body.bootstrap_room)
    return GenerateRequest(rid=body.rid or new_rid(), input_ids=input_ids, sampling=sampling,
                           seed=choose_seed(seed, bootstrap, sampling), stream=body.stream,
                           return_logprob=body.return_logprob, bootstrap=bootstrap)


def _openai_request(node: NodeIdentity, body, input_ids: list[int], max_tokens: int | None,
                    return_logprob: bool) -> GenerateRequest:
    max_new = check_lengths(node, input_ids, max_tokens)
    sampling = make_sampling(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                             max_new_tokens=max_new, stop=body.stop, stop_token_ids=body.stop_token_ids,
                             ignore_eos=body.ignore_eos, seed=body.seed)
    bootstrap = resolve_bootstrap(node, body.bootstrap_host, body.bootstrap_port, body.bootstrap_room)
    return GenerateRequest(rid=new_rid(), input_ids=input_ids, sampling=sampling,
                           seed=choose_seed(body.seed, bootstrap, sampling), stream=body.stream,
                           return_logprob=return_logprob, bootstrap=bootstrap)


def from_completion(node: NodeIdentity, tokenizer, body: CompletionBody) -> GenerateRequest:
    check_model(node, body.model)
    refuse_unsupported(n=body.n, best_of=body.best_of, echo=body.echo, frequency_penalty=body.frequency_penalty,
                       presence_penalty=body.presence_penalty, min_p=body.min_p)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError(400, "a list of several prompts is not supported; send one request per prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        input_ids = tokenizer.encode(prompt)
    else:
        input_ids = list(prompt)
        check_token_ids(node, input_ids, "prompt")
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
    return _openai_request(node, body, input_ids, max_tokens, return_logprob=body.logprobs is not None)


def from_chat(node: NodeIdentity, tokenizer, body: ChatCompletionBody) -> GenerateRequest:
    check_model(node, body.model)
    refuse_unsupported(n=body.n, frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
                       min_p=body.min_p)
    prompt, add_special = render_messages(getattr(tokenizer, "chat_template", None), body.messages,
                                          body.chat_template_kwargs)
    input_ids = tokenizer.encode(prompt, add_special_tokens=add_special)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    return _openai_request(node, body, input_ids, max_tokens, return_logprob=bool(body.logprobs))
