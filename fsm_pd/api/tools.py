"""OpenAI tool calling in chat: the tools into the prompt, the model's calls out of its text into ``tool_calls``.

* **Format.** Read off the chat template: one that writes ``<tool_call>`` is Qwen's (a call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several may follow each other); one that mentions
  ``"parameters"`` or ``<|python_tag|>`` without it is Llama 3's (the whole answer is ``{"name": ..., "parameters":
  {...}}``, several joined by ``;``). The template gets ``tools`` (HF's convention) and renders them itself. A template
  that never reads ``tools`` (or none at all) would drop them silently, so fsm-pd then describes the tools in a
  system message of its own, in Qwen's format, and parses that format.
* **tool_choice.** ``none``: no tools in the prompt, nothing parsed. ``auto``: tools in the prompt; the answer is
  parsed. ``required`` and a named function: the answer is also *constrained* to one call of a listed (or the named)
  function whose arguments follow its ``parameters`` schema (a Lark grammar with ``%json``, through the structured
  output grammar: ``model/grammar.py``), so it is one even from a weak model.
* **Malformed output stays content.** A call that does not parse as JSON, names no function, or names a function
  that was not offered, leaves the whole answer as plain ``content`` with no ``tool_calls``.
* **Streaming.** Text is streamed as content until it could be the start of a call (Qwen: a tail that may begin
  ``<tool_call>``; Llama 3: an answer whose first character is ``{`` or that begins ``<|python_tag|>``); from there it
  is held back and parsed at the end: each call is one ``tool_calls`` delta with its whole ``arguments`` (clients
  concatenate argument fragments, so one fragment is valid), then ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from fsm_pd.api.errors import ApiError
from fsm_pd.model.grammar import GrammarSpec

QWEN, LLAMA3 = "qwen", "llama3"
QWEN_OPEN, QWEN_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_QWEN_BLOCK = re.compile(re.escape(QWEN_OPEN) + r"(.*?)" + re.escape(QWEN_CLOSE), re.DOTALL)
# compact JSON inside a forced call: a weak model could otherwise emit blanks until max_tokens
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request does with tools: the format, the offered functions, and whether to parse at all."""

    fmt: str
    names: frozenset[str]
    parallel: bool = True  # parallel_tool_calls=false: at most one call is returned


def template_format(template: str | None) -> tuple[str, bool]:
    """(format, whether the template renders ``tools`` itself)."""
    if template is None or "tools" not in template:
        return QWEN, False
    if QWEN_OPEN in template:
        return QWEN, True
    if PYTHON_TAG in template or "parameters" in template:
        return LLAMA3, True
    return QWEN, True


def tool_dicts(tools) -> list[dict]:
    return [tool.model_dump(exclude_none=True) for tool in tools or ()]


def fallback_system_text(tools: list[dict]) -> str:
    """fsm-pd's own description of the tools, for a template that does not render them (Qwen's call format)."""
    lines = ["You may call the functions below. To call one, answer with one line per call:",
             f'{QWEN_OPEN}{{"name": <function name>, "arguments": <JSON object>}}{QWEN_CLOSE}', "Functions:"]
    lines += [json.dumps(tool["function"], ensure_ascii=False) for tool in tools]
    return "\n".join(lines)


def chosen_name(tool_choice) -> str | None:
    if tool_choice is None or isinstance(tool_choice, str):
        return None
    return tool_choice.function.name


def plan_tools(body, template: str | None) -> ToolPlan | None:
    """Checks ``tools`` / ``tool_choice`` / ``parallel_tool_calls``; None when no tool can be called."""
    tools = tool_dicts(body.tools)
    choice = body.tool_choice
    parallel = body.parallel_tool_calls is not False
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, f"tool_choice={_choice_text(choice)} needs tools")
        return None
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: two functions have the same name")
    if (name := chosen_name(choice)) is not None and name not in names:
        raise ApiError(400, f"tool_choice names the function {name!r}, which is not in tools")
    if choice == "none":
        return None
    return ToolPlan(template_format(template)[0], frozenset(names), parallel)


def _choice_text(choice) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice.model_dump())


def forced_grammar(body, plan: ToolPlan) -> GrammarSpec | None:
    """For ``required`` or a named function: the grammar of one call (of the named function, or any offered)."""
    choice = body.tool_choice
    name = chosen_name(choice)
    if choice != "required" and name is None:
        return None
    functions = [t["function"] for t in tool_dicts(body.tools) if name is None or t["function"]["name"] == name]
    args_key = "parameters" if plan.fmt == LLAMA3 else "arguments"
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                  args_key: f.get("parameters") or {"type": "object"}},
                "required": ["name", args_key], "additionalProperties": False} for f in functions]
    schema = {**(options[0] if len(options) == 1 else {"anyOf": options}), "x-guidance": _COMPACT}
    call = "%json " + json.dumps(schema)
    lark = f'start: "{QWEN_OPEN}\\n" call "\\n{QWEN_CLOSE}"\ncall: {call}' if plan.fmt == QWEN else f"start: {call}"
    try:
        return GrammarSpec("ebnf", lark)
    except ValueError as err:
        raise ApiError(400, f"tools: the parameters of {', '.join(f['name'] for f in functions)} are not a schema "
                            f"fsm-pd can follow: {err}") from err


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _one_call(text: str, args_keys: tuple[str, ...], names: frozenset[str]) -> ParsedCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in names:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a whole answer. Anything malformed: (the whole text, [])."""
    if plan.fmt == QWEN:
        blocks = list(_QWEN_BLOCK.finditer(text))
        if not blocks:
            return text, []
        rest = _QWEN_BLOCK.sub("", text)
        if QWEN_OPEN in rest or QWEN_CLOSE in rest:  # an unclosed or stray tag: not a well-formed call
            return text, []
        calls = [_one_call(b.group(1).strip(), ("arguments", "parameters"), plan.names) for b in blocks]
        content = text[: blocks[0].start()].strip()
        tail = text[blocks[-1].end():].strip()
        if tail:
            content = f"{content}\n{tail}".strip()
    else:
        body = text.strip()
        body = body[len(PYTHON_TAG):].strip() if body.startswith(PYTHON_TAG) else body
        if not body.startswith("{"):
            return text, []
        calls = [_one_call(part.strip(), ("parameters", "arguments"), plan.names) for part in _split_top(body)]
        content = ""
    if not calls or any(c is None for c in calls):
        return text, []
    return content or None, calls if plan.parallel else calls[:1]


def _split_top(text: str) -> list[str]:
    """Llama 3's calls joined by ``;``: split at the semicolons outside JSON strings and brackets."""
    parts, depth, start, in_str, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            escaped, in_str = (not escaped and ch == "\\"), in_str and (escaped or ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


@dataclass(slots=True)
class ToolStreamer:
    """Splits a streamed answer into content that is certainly not a call (sent at once) and a held-back part that
    may be one (parsed at the end)."""

    plan: ToolPlan
    seen: str = ""
    sent: int = 0  # characters of ``seen`` sent as content
    holding: bool = False
    calls: list[ParsedCall] = field(default_factory=list)

    def feed(self, delta: str) -> str:
        self.seen += delta
        if self.holding:
            return ""
        if self.plan.fmt == LLAMA3:
            head = self.seen.lstrip()
            if not head:
                return ""
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self.holding = True
                return ""
            if PYTHON_TAG.startswith(head):  # may still become the tag: wait for more
                return ""
            return self._send(len(self.seen))
        at = self.seen.find(QWEN_OPEN, self.sent)
        if at >= 0:
            self.holding = True
            return self._send(at)
        # hold back a tail that could be the start of "<tool_call>"
        keep = next((n for n in range(min(len(QWEN_OPEN) - 1, len(self.seen)), 0, -1)
                     if self.seen.endswith(QWEN_OPEN[:n])), 0)
        return self._send(len(self.seen) - keep)

    def _send(self, upto: int) -> str:
        out, self.sent = self.seen[self.sent:upto], max(self.sent, upto)
        return out

    def finish(self) -> str:
        """The content still to send once the answer is complete; ``calls`` then holds the parsed calls."""
        if not self.holding:
            return self._send(len(self.seen))
        _, self.calls = parse_tool_calls(self.seen, self.plan)
        if not self.calls:
            return self._send(len(self.seen))  # malformed: the held text is content after all
        self.sent = len(self.seen)
        if self.plan.fmt == QWEN:  # text after the last call; what came before the first was sent already
            return self.seen[self.seen.rfind(QWEN_CLOSE) + len(QWEN_CLOSE):].strip()
        return ""
