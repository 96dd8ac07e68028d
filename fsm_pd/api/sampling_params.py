"""A body's sampling parameters (SGLang's ``sampling_params``, or an OpenAI body's fields of the same names) as the
engine's ``SamplingParams``, and the fields fsm-pd does not serve, refused by name with a 400 rather than ignored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsm_pd.api.errors import ApiError
from fsm_pd.api.request_checks import check_token_ids
from fsm_pd.model.grammar import grammar_of
from fsm_pd.model.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from fsm_pd.api.request_checks import NodeIdentity

NEUTRAL = {  # fields fsm-pd does not serve (yet), with the values that mean "not used"
    "structural_tag": (None,),
    "min_new_tokens": (None, 0), "skip_special_tokens": (None, True), "spaces_between_special_tokens": (None, True),
    "lora_path": (None,), "image_data": (None,), "return_hidden_states": (None, False),
    "custom_logit_processor": (None,), "tools": (None, []),
    "tool_choice": (None, "none"), "parallel_tool_calls": (None, True), "suffix": (None, ""),
}
WHY = {
    "structural_tag": "structural tags are not served yet (json_schema, regex, ebnf and response_format are)",
    "tools": "tools are served in chat completions only", "tool_choice": "tools are served in chat completions only",
    "parallel_tool_calls": "tools are served in chat completions only",
}


def refuse_unsupported(body, *names: str) -> None:
    """A 400 naming the first field of ``names`` that holds anything but its neutral value."""
    for name in names:
        value = getattr(body, name)
        if value not in NEUTRAL[name]:
            why = WHY.get(name, "fsm-pd does not serve it")
            raise ApiError(400, f"{name}={value!r} is not supported: {why}")


def logit_bias_items(bias: dict[str, float] | None, node: NodeIdentity) -> tuple[tuple[int, float], ...]:
    items = []
    for key, value in (bias or {}).items():
        try:
            tid = int(key)
        except ValueError:
            raise ApiError(400, f"logit_bias keys are token ids, got {key!r}") from None
        items.append((tid, float(value)))
    check_token_ids(node, [t for t, _ in items], "logit_bias")
    return tuple(items)


def top_logprobs_num(value: int | None, name: str) -> int:
    """How many alternatives per position: 0 to ``MAX_TOP_LOGPROBS`` (20, as SGLang and OpenAI)."""
    k = int(value or 0)
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {k}")
    return k


def make_sampling(node: NodeIdentity, src, *, max_new_tokens, seed, repetition_penalty=None) -> SamplingParams:
    """SamplingParams from a body (``src``: SGLang's sampling_params or an OpenAI body: the same names)."""
    stop = src.stop
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    check_token_ids(node, list(src.stop_token_ids or ()), "stop_token_ids")
    try:
        return SamplingParams(
            temperature=1.0 if src.temperature is None else float(src.temperature),
            top_p=1.0 if src.top_p is None else float(src.top_p),
            top_k=0 if src.top_k is None or src.top_k < 0 else int(src.top_k),  # SGLang's -1 means "all", as 0 does
            min_p=float(src.min_p or 0.0),
            max_new_tokens=max(1, max_new_tokens),  # 0: one token is generated and not shown
            stop=stops,
            stop_token_ids=tuple(src.stop_token_ids or ()),
            ignore_eos=bool(src.ignore_eos) or max_new_tokens == 0,
            seed=seed,
            frequency_penalty=float(src.frequency_penalty or 0.0),
            presence_penalty=float(src.presence_penalty or 0.0),
            repetition_penalty=1.0 if repetition_penalty is None else float(repetition_penalty),
            logit_bias=logit_bias_items(src.logit_bias, node),
            no_stop_trim=bool(src.no_stop_trim),
            grammar=grammar_of(src),  # json_schema, regex, ebnf, or OpenAI's response_format
        )
    except ValueError as err:
        raise ApiError(400, str(err)) from err
