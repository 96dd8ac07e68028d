"""Request bodies to ``Plan``s of ``GenerateRequest``s: tokenising, PD bootstrap fields, and fan-out; the checks
against the node are ``request_checks.py``'s, the sampling parameters ``sampling_params.py``'s. The routes build a
plan on a worker thread (``build_plan``): a long prompt's tokenizing never holds the event loop.

Fan-out: a batch of prompts and ``n`` (or ``best_of``) completions per prompt become one engine request each, at this
layer. Request ``k`` (prompt ``k // copies``, copy ``k % copies``) gets the rid ``{rid}-{k}``, the bootstrap room
``derive(room, k)`` and, with an explicit seed, the seed ``derive(seed, k)`` (``k = 0`` keeps the room and seed as
they are). A PD prefill and decode node get the same body from the router and derive the same rooms and seeds, so
every copy meets its partner and samples deterministically.

``max_new_tokens = 0`` (SGLang; OpenAI's ``max_tokens = 0``): the engine generates one token, which is not shown.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from starlette.concurrency import run_in_threadpool

from fsm_pd.api.chat_template import render_messages
from fsm_pd.api.errors import ApiError
from fsm_pd.api.request_checks import (
    NodeIdentity,
    check_lengths,
    check_model,
    check_text_length,
    check_token_ids,
)
from fsm_pd.api.sampling_params import make_sampling, refuse_unsupported, top_logprobs_num
from fsm_pd.api.schemas import (
    MAX_BATCH,
    ChatCompletionBody,
    CompletionBody,
    GenerateBody,
    ResumeField,
    SGLangSamplingParams,
)
from fsm_pd.api.tools import ToolPlan, forced_grammar, plan_tools, tool_dicts
from fsm_pd.model.grammar import GrammarSpec
from fsm_pd.model.sampling_params import SamplingParams
from fsm_pd.net.unix_sockets import is_unix
from fsm_pd.runtime.random_bits import random_bits
from fsm_pd.serving.types import Bootstrap, GenerateRequest

GENERATE_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default for /generate
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and SGLang's) default for /v1/completions
PD_ROLES = ("prefill", "decode")


def new_rid() -> str:
    """32 random hex digits, as ``uuid4().hex`` gave, from the process's batch of the OS's randomness: each
    ``uuid4`` read ``os.urandom``, and on the TPU host that read and the one for the seed held a request's planning
    about 3 ms (the thread let go of the interpreter's lock and waited to get it back; round r13's stack samples)."""
    return f"{random_bits(64):016x}{random_bits(64):016x}"


def resolve_bootstrap(node: NodeIdentity, host: str | None, port: int | None, room: int | None,
                      route=None) -> Bootstrap | None:
    """SGLang's PD fields. A colocated node ignores them; a prefill/decode node needs host and room, and takes
    its own bootstrap port when the router sent ``bootstrap_port: null`` (as SGLang's decode does). ``route`` (the
    fsm-pd router's ``fsm_pd_route``) with path ``local``: the node serves the request whole (``local_path.py``) and
    needs only the room. A ``unix:PATH`` host names a bootstrap server on a unix socket, which needs no port."""
    if node.role not in PD_ROLES:
        return None
    # a local request: a decode node serves it, a prefill node with --serve-local too (its engine refuses it else)
    if route is not None and route.path == "local":
        if room is None:
            raise ApiError(400, "fsm_pd_route local needs bootstrap_room (the attempt's identity on this node)")
        return Bootstrap(host="", port=0, room=room, local=True)
    port = port if port is not None else 0 if is_unix(host) else node.bootstrap_port
    if host is None or room is None or port is None:
        missing = [n for n, v in (("bootstrap_host", host), ("bootstrap_port", port), ("bootstrap_room", room))
                   if v is None]
        raise ApiError(400, f"a {node.role} node serves only requests routed by a PD router: missing "
                            f"{', '.join(missing)}")
    if not host:
        raise ApiError(400, "bootstrap_host must be a non-empty host name")
    return Bootstrap(host=host, port=port, room=room)


async def build_plan(make_plan, node: NodeIdentity, tokenizer, body) -> Plan:
    """``make_plan(node, tokenizer, body)`` (``from_generate``, ``from_completion``, ``from_chat``) on a worker
    thread: rendering and tokenizing a prompt of up to the body limit takes time the event loop's other requests
    (streams, health checks) must not wait for."""
    return await run_in_threadpool(make_plan, node, tokenizer, body)


def route_of(body) -> dict | None:
    """The router's ``fsm_pd_route`` as the engine keeps it (journaled on a decode node, echoed in ``meta_info``)."""
    route = getattr(body, "fsm_pd_route", None)
    return None if route is None else {"path": route.path, "reason": route.reason}


def derive(value: int, k: int, bits: int = 63) -> int:
    """The k-th value derived from ``value`` (itself for k = 0): a hash, so copies do not collide with rooms or seeds
    of other requests."""
    if k == 0:
        return value
    digest = hashlib.blake2b(f"{value}:{k}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << bits) - 1)


def choose_seed(seed: int | None, bootstrap: Bootstrap | None, params: SamplingParams) -> int:
    """An explicit seed wins. Without one, a PD request takes its seed from the room: the prefill and decode nodes
    get the same body from the router and must sample with the same seed, and the room is what they share."""
    if seed is not None:
        return seed
    if bootstrap is not None:
        return bootstrap.room & 0x7FFFFFFF
    return params.resolved_seed()


@dataclass(slots=True)
class Plan:
    """What one HTTP request runs: ``requests`` (prompt-major, ``copies`` per prompt), of which the best ``keep``
    per prompt are answered (``best_of``: ranked by the sum of output logprobs; else all)."""

    requests: list[GenerateRequest]
    prompts: list[list[int]]
    copies: int = 1
    keep: int = 1
    batched: bool = False  # the client sent a list of prompts: the answer is a list
    hide_output: bool = False  # max tokens 0
    stream: bool = False
    tools: ToolPlan | None = None  # chat with tools: the answers' calls are parsed (api.tools)
    resumed: bool = False  # a migrated stream's continuation (fsm_pd_resume): its client has the stream's head

    @property
    def single(self) -> bool:
        return len(self.requests) == 1 and not self.batched

    def fan_out(self, base: GenerateRequest, prompt_index: int) -> list[GenerateRequest]:
        out = []
        for copy in range(self.copies):
            k = prompt_index * self.copies + copy
            boot = base.bootstrap if base.bootstrap is None else replace(base.bootstrap,
                                                                          room=derive(base.bootstrap.room, k))
            seed = derive(base.seed, k)  # the same on both PD nodes: base.seed is (explicit, or the shared room's)
            out.append(replace(base, rid=base.rid if self.single_rid else f"{base.rid}-{k}", seed=seed,
                               bootstrap=boot, input_ids=list(base.input_ids)))
        return out

    @property
    def single_rid(self) -> bool:
        return self.copies == 1 and not self.batched


def _prompts_of_generate(node: NodeIdentity, tokenizer, body: GenerateBody) -> tuple[list[list[int]], bool]:
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "give exactly one of text or input_ids")
    if body.input_ids is not None:
        batched = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        prompts = [list(p) for p in body.input_ids] if batched else [list(body.input_ids)]
        for p in prompts:
            check_token_ids(node, p, "input_ids")
    else:
        batched = isinstance(body.text, list)
        prompts = [encode(node, tokenizer, t) for t in (body.text if batched else [body.text])]
    if batched and not 1 <= len(prompts) <= MAX_BATCH:
        raise ApiError(400, f"a batch holds 1 to {MAX_BATCH} prompts, got {len(prompts)}")
    return prompts, batched


def encode(node: NodeIdentity, tokenizer, text: str, **options) -> list[int]:
    """A text prompt's ids; one too long for the context whatever its tokens is refused before it is tokenized."""
    check_text_length(node, text)
    return tokenizer.encode(text, **options)


def budget(node: NodeIdentity, input_ids: list[int], before: list[int], max_new: int | None) -> tuple[list[int], int]:
    """The ids a request prefills and how many tokens it may generate. A migrated stream's earlier tokens
    (``before``) continue its prompt and count against its max tokens."""
    if not before:
        return input_ids, check_lengths(node, input_ids, max_new)
    left = None if max_new is None else max_new - len(before)
    if left is not None and left < 1:
        raise ApiError(400, f"fsm_pd_resume: {len(before)} tokens generated already, max tokens {max_new}: nothing "
                            "is left to generate")
    ids = input_ids + before
    return ids, check_lengths(node, ids, left)


def _build(node: NodeIdentity, plan: Plan, rid: str | None, make, resume: ResumeField | None = None) -> Plan:
    """Fill ``plan.requests``: ``make(input_ids, before)`` gives each prompt's base request (``before``: the tokens
    a resumed stream generated already, ``fsm_pd_resume``)."""
    rid = rid or new_rid()
    before: list[int] = []
    if resume is not None:
        if len(plan.prompts) != 1 or plan.copies != 1 or plan.batched:
            raise ApiError(400, "fsm_pd_resume continues one stream: a single prompt and n = 1")
        check_token_ids(node, resume.output_ids, "fsm_pd_resume.output_ids")
        before, plan.resumed = list(resume.output_ids), True
    for j, ids in enumerate(plan.prompts):
        base = make(ids, before)
        base.rid = rid
        plan.requests.extend(plan.fan_out(base, j))
    if resume is not None and resume.seed is not None:  # a sampled stream goes on with the same draws
        plan.requests[0].seed = resume.seed
    return plan


def from_generate(node: NodeIdentity, tokenizer, body: GenerateBody) -> Plan:
    check_model(node, body.model)
    refuse_unsupported(body, "lora_path", "image_data", "return_hidden_states", "custom_logit_processor")
    top_k = top_logprobs_num(body.top_logprobs_num, "top_logprobs_num")
    start = -1 if body.logprob_start_len is None else body.logprob_start_len
    if start < -1:
        raise ApiError(400, f"logprob_start_len must be -1 (the whole prompt) or a position, got {start}")
    sp = body.sampling_params or SGLangSamplingParams()
    refuse_unsupported(sp, "structural_tag", "min_new_tokens", "skip_special_tokens", "spaces_between_special_tokens")
    prompts, batched = _prompts_of_generate(node, tokenizer, body)
    max_new = sp.max_new_tokens if sp.max_new_tokens is not None else GENERATE_DEFAULT_MAX_NEW_TOKENS
    seed = sp.seed if sp.seed is not None else sp.sampling_seed
    bootstrap = resolve_bootstrap(node, body.bootstrap_host, body.bootstrap_port, body.bootstrap_room,
                                  body.fsm_pd_route)
    plan = Plan([], prompts, copies=sp.n or 1, keep=sp.n or 1, batched=batched, hide_output=max_new == 0,
                stream=body.stream)

    def make(prompt: list[int], before: list[int]) -> GenerateRequest:
        input_ids, new = budget(node, prompt, before, max_new)
        sampling = make_sampling(node, sp, max_new_tokens=new, seed=seed, repetition_penalty=sp.repetition_penalty)
        return GenerateRequest(rid="", input_ids=input_ids, sampling=sampling,
                               seed=choose_seed(seed, bootstrap, sampling), stream=body.stream,
                               return_logprob=body.return_logprob, bootstrap=bootstrap, top_logprobs_num=top_k,
                               logprob_start_len=max(start, 0), text_in_logprobs=bool(body.return_text_in_logprobs),
                               generated_before=before, route=route_of(body))

    return _build(node, plan, body.rid, make, body.fsm_pd_resume)


def _openai_plan(node: NodeIdentity, body, prompts: list[list[int]], max_tokens: int | None, return_logprob: bool,
                 *, batched: bool = False, copies: int = 1, keep: int = 1, tools: ToolPlan | None = None,
                 grammar: GrammarSpec | None = None, top_k: int = 0) -> Plan:
    refuse_unsupported(body, "skip_special_tokens")
    bootstrap = resolve_bootstrap(node, body.bootstrap_host, body.bootstrap_port, body.bootstrap_room,
                                  body.fsm_pd_route)
    plan = Plan([], prompts, copies=copies, keep=keep, batched=batched, hide_output=max_tokens == 0,
                stream=body.stream, tools=tools)

    def make(prompt: list[int], before: list[int]) -> GenerateRequest:
        input_ids, new = budget(node, prompt, before, max_tokens)
        sampling = make_sampling(node, body, max_new_tokens=new, seed=body.seed,
                                 repetition_penalty=body.repetition_penalty)
        if grammar is not None:  # tool_choice required or named: the answer is one call
            if sampling.grammar is not None:
                raise ApiError(400, "tool_choice that forces a call cannot be combined with response_format, "
                                    "json_schema, regex or ebnf")
            sampling = replace(sampling, grammar=grammar)
        return GenerateRequest(rid="", input_ids=input_ids, sampling=sampling,
                               seed=choose_seed(body.seed, bootstrap, sampling), stream=body.stream,
                               return_logprob=return_logprob, bootstrap=bootstrap, top_logprobs_num=top_k,
                               generated_before=before, route=route_of(body))

    return _build(node, plan, body.rid, make, body.fsm_pd_resume)


def from_completion(node: NodeIdentity, tokenizer, body: CompletionBody) -> Plan:
    check_model(node, body.model)
    refuse_unsupported(body, "suffix", "tools", "tool_choice", "parallel_tool_calls")
    prompt = body.prompt
    batched = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
    items = prompt if batched else [prompt]
    if batched and not 1 <= len(items) <= MAX_BATCH:
        raise ApiError(400, f"a batch holds 1 to {MAX_BATCH} prompts, got {len(items)}")
    prompts = []
    for item in items:
        ids = encode(node, tokenizer, item) if isinstance(item, str) else list(item)
        if not isinstance(item, str):
            check_token_ids(node, ids, "prompt")
        prompts.append(ids)
    max_tokens = body.max_tokens if body.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
    if max_tokens == 0 and not body.echo:
        raise ApiError(400, "max_tokens=0 returns nothing without echo=true")
    n = body.n or 1
    best_of = body.best_of or n
    if best_of < n:
        raise ApiError(400, f"best_of ({best_of}) must be at least n ({n})")
    if best_of > n and body.stream:
        raise ApiError(400, "best_of > n cannot be streamed (as OpenAI)")
    return _openai_plan(node, body, prompts, max_tokens, return_logprob=body.logprobs is not None or best_of > n,
                        batched=batched and len(items) > 1, copies=best_of, keep=n,
                        top_k=top_logprobs_num(body.logprobs, "logprobs"))


def from_chat(node: NodeIdentity, tokenizer, body: ChatCompletionBody) -> Plan:
    check_model(node, body.model)
    top_k = top_logprobs_num(body.top_logprobs, "top_logprobs")
    if top_k and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true (as OpenAI)")
    template = getattr(tokenizer, "chat_template", None)
    tools = plan_tools(body, template)  # None: tool_choice none, or no tools
    prompt, add_special = render_messages(template, body.messages, body.chat_template_kwargs,
                                          tool_dicts(body.tools) if tools else None)
    input_ids = encode(node, tokenizer, prompt, add_special_tokens=add_special)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens == 0:
        raise ApiError(400, "max_tokens=0 is not served in chat (nothing would be returned)")
    n = body.n or 1
    return _openai_plan(node, body, [input_ids], max_tokens, return_logprob=bool(body.logprobs), copies=n, keep=n,
                        tools=tools, grammar=forced_grammar(body, tools) if tools else None, top_k=top_k)
