"""Selective disaggregation: per request, the built-in router sends a prompt through a prefill node (``pd``) or has
the decode node prefill it itself (``local``). ``decide`` is a pure function of what the router knows, so the policy
is tested without a fleet, and the reason it gives is what the journal, ``replay --request`` and ``meta_info``
show.

Why a request would not be disaggregated: a PD request pays a fixed cost (two HTTP legs, a bootstrap handshake, a
KV transfer and its scatter) that buys nothing when the prompt is short, and a prefill node whose prompts are all
short sits idle while its decode node carries every stream. ``bench/goodput.py`` measured it on 2 CPU cores
(SmolLM2, P and D on one core each against one colocated node on both; ``docs/serving.md``): PD loses at 48-token
prompts with 128 new tokens, wins at 480-token prompts with 16. sglang-omni saw break-even near 1024 tokens on GPUs.

The rule of ``--pd-policy auto``:

1. no healthy prefill worker: ``local`` (the decode node can serve alone; ``always`` answers 503 instead);
2. the prompt is at most ``--local-prefill-max-tokens`` (default 256, between the two measured mixes): ``local``;
3. it is at most twice that and the prefill side is busier than the decode side (the chosen prefill worker has more
   of this router's prompts to prefill, those without a first token yet, than the chosen decode worker has local
   ones): ``local``; a queue at P costs the request more than a short prefill costs D's streams. Prompts, not
   requests in flight: every PD request stays in flight at its decode worker until its stream ends, so D's count of
   requests is never below P's, and a rule on those counts (this one, until the stop-38 sweep showed it never
   fired) leaves D's core idle while prompts queue at P;
4. otherwise ``pd``.

A local request goes to the decode node, or, when the prefill workers serve both roles (``--serve-local`` on them,
``--prefill-serves-local`` on the router) and the chosen prefill worker has fewer requests in flight than the
chosen decode worker, to that prefill node, which then prefills and decodes it itself (rule 2's requests; rule 3's
go to the decode node, since the prefill side is the busier there).

What it leaves out, and why: the cached prefix. A local prefill on the decode node computes the whole prompt (it does
not reuse that node's radix cache, ``--disaggregation-decode-enable-radix-cache``, yet), so a prefix the router
believes a decode node holds would make the estimate wrong, not better. A prefix cached on the prefill node makes PD
cheaper there, but cannot turn a short prompt's decision (local is already the cheaper path for it) and a long
prompt goes through P anyway. When the local prefill reuses the decode node's cache, its uncached remainder becomes
the length compared here.

``auto`` is the default: in every mix and grid cell measured (``docs/crossover.md``) its goodput was at least classic
PD's, and on short prompts with long answers, where classic PD loses to colocated by up to 3x, it wins most of that
back. ``always`` is classic PD (every request through a prefill node, as sglang-router does:
``CLASSIC_PD``), for a fleet whose decode nodes must not prefill or to measure the handoff itself. ``never``
prefills every request on the decode node (a decode fleet that serves colocated). The threshold comes from the
crossover measured on 2 CPU cores; ``bench/goodput.py --sweep`` re-derives it on the hardware at hand.

The router sees a prompt as text or token ids. Ids are counted exactly; text is estimated without a tokenizer
(``estimate_tokens``): the byte-level BPE tokenizers these models use (SmolLM2's, Llama 3's, Qwen's) first split text
into words, digits, runs of punctuation and of whitespace, and merge each piece into one token or a few, so the
count of those pieces, weighted, follows the token count far better than characters do. Calibrated on SmolLM2's
tokenizer over this repository's prose and Python and plain English (``tests/unit/test_router_policy.py``): within
-16% / +11% of the true count, where 3.5 characters a token was off by -26% (markdown) to +36% (English prose; a
chat was reported at 1,034 for 669 tokens). The estimate only has to place a prompt on the right side of a threshold
a few hundred tokens wide.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from typing import Any

MODES = ("auto", "always", "never")
PATHS = ("pd", "local")
# estimate_tokens: what one piece of text costs in tokens, fitted on SmolLM2's tokenizer (the module's docstring)
_WORDS = re.compile(r"'(?:s|t|re|ve|m|ll|d)| ?[^\W\d_]+|\d")  # a word with its leading space, or one digit
_LONG_WORDS = re.compile(r"[^\W\d_]{9,}")  # rarer: usually split in two or more
_PUNCTUATION = re.compile(r"[^\w\s]+")
WORD_TOKENS, LONG_WORD_EXTRA, PUNCTUATION_RUN_TOKENS, PUNCTUATION_CHAR_TOKENS = 1.0, 1.5, 1.25, 0.15
CHAT_MESSAGE_TOKENS, CHAT_PROMPT_TOKENS = 5, 3  # a chat template's role markers per message, and the reply's
DEFAULT_LOCAL_PREFILL_MAX_TOKENS = 256
BUSY_FACTOR = 2  # rule 3: up to this many times the threshold when the prefill side is the busier


@dataclass(frozen=True, slots=True)
class PolicySettings:
    mode: str = "auto"
    local_prefill_max_tokens: int = DEFAULT_LOCAL_PREFILL_MAX_TOKENS
    idle_window: int = 50  # requests the idle-prefill alarm looks back over (``PrefillIdleWatch``)
    prefill_serves_local: bool = False  # the prefill workers run --serve-local: a local request may go there

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--pd-policy must be one of {MODES}, got {self.mode!r}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"--local-prefill-max-tokens must not be negative, got {self.local_prefill_max_tokens}")
        if self.idle_window < 1:
            raise ValueError(f"--prefill-idle-window must be at least 1, got {self.idle_window}")


CLASSIC_PD = PolicySettings("always")


@dataclass(frozen=True, slots=True)
class RouteInput:
    """What the router knows of one request when it picks its path."""

    prompt_tokens: int  # counted (ids) or estimated (text)
    exact: bool  # the prompt came as token ids
    prefill_outstanding: int = 0  # this router's requests in flight at the chosen prefill worker
    decode_outstanding: int = 0  # ... and at the chosen decode worker
    prefill_available: bool = True  # a healthy prefill worker was found
    prefill_prefilling: int = 0  # of those at the prefill worker, the prompts it is prefilling (no first token yet)
    decode_prefilling: int = 0  # ... and at the decode worker (its local requests before their first token)


@dataclass(frozen=True, slots=True)
class Route:
    path: str  # "pd" or "local"
    reason: str
    where: str = "decode"  # which worker serves a local request: "decode", or "prefill" (``prefill_serves_local``)

    def wire(self) -> dict:
        """The ``fsm_pd_route`` field the decode node gets (journaled there, echoed in ``meta_info.pd_route``)."""
        return {"path": self.path, "reason": self.reason}


def decide(settings: PolicySettings, seen: RouteInput) -> Route:
    if settings.mode == "always":
        return Route("pd", "policy always")
    if settings.mode == "never":
        return Route("local", "policy never")
    if not seen.prefill_available:
        return Route("local", "no healthy prefill worker")
    tokens = seen.prompt_tokens
    what = f"{tokens} prompt tokens" if seen.exact else f"~{tokens} prompt tokens (estimated from its text)"
    limit = settings.local_prefill_max_tokens
    if tokens <= limit:
        return _local_on(settings, seen, f"{what} <= {limit}")
    if tokens <= BUSY_FACTOR * limit and seen.prefill_prefilling > seen.decode_prefilling:
        return Route("local", f"{what} <= {BUSY_FACTOR}x{limit} and prefill busier ({seen.prefill_prefilling} "
                              f"prompts prefilling against decode's {seen.decode_prefilling})")
    return Route("pd", f"{what} > {limit}")


def _local_on(settings: PolicySettings, seen: RouteInput, reason: str) -> Route:
    """A node that serves both roles (``--serve-local`` on the prefill workers): the local request goes to whichever
    of the two chosen workers has fewer of this router's requests in flight, so an idle prefill core takes work."""
    if settings.prefill_serves_local and seen.prefill_outstanding < seen.decode_outstanding:
        return Route("local", f"{reason}; on the prefill node ({seen.prefill_outstanding} in flight against "
                              f"decode's {seen.decode_outstanding})", where="prefill")
    return Route("local", reason)


def prompt_tokens(body: Any) -> tuple[int, bool]:
    """The prompt's length as the router can tell it without a tokenizer: ``(tokens, exact)``. Ids are counted;
    text (``text``, ``prompt``, chat ``messages``) is estimated (``estimate_tokens``), a chat with its template's
    markers. A batch counts its longest prompt (its copies go one path together)."""
    if not isinstance(body, dict):
        return 0, False
    ids = body.get("input_ids")
    if ids is None and isinstance(body.get("prompt"), list) and body["prompt"] and isinstance(body["prompt"][0], int):
        ids = body["prompt"]
    if isinstance(ids, list) and ids:
        if isinstance(ids[0], list):
            return max(len(p) for p in ids if isinstance(p, list)), True
        return len(ids), True
    for name in ("text", "prompt"):
        value = body.get(name)
        if isinstance(value, str):
            return estimate_tokens(value), False
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return max(estimate_tokens(v) for v in value), False
        if isinstance(value, list) and value and isinstance(value[0], list):
            return max(len(p) for p in value), True
    messages = body.get("messages")
    if isinstance(messages, list):
        contents = [m.get("content") for m in messages if isinstance(m, dict)]
        texts = [c if isinstance(c, str) else " ".join(str(p.get("text", "")) for p in c if isinstance(p, dict))
                 if isinstance(c, list) else "" for c in contents]
        return (sum(estimate_tokens(t) for t in texts) + CHAT_MESSAGE_TOKENS * len(texts) + CHAT_PROMPT_TOKENS,
                False)
    return 0, False


def estimate_tokens(text: str) -> int:
    """Tokens of ``text`` under a byte-level BPE tokenizer, from the pieces it splits text into (module docstring);
    about 2 ms for 30,000 characters."""
    punctuation = _PUNCTUATION.findall(text)
    return round(WORD_TOKENS * len(_WORDS.findall(text)) + LONG_WORD_EXTRA * len(_LONG_WORDS.findall(text))
                 + PUNCTUATION_RUN_TOKENS * len(punctuation)
                 + PUNCTUATION_CHAR_TOKENS * sum(len(run) for run in punctuation))


class PrefillIdleWatch:
    """The alarm of a fleet whose prefill nodes served nothing while traffic flowed (``fsm_pd_router_prefill_idle_
    alarm``): one operator benchmarked "PD" whose prefill engine had served 0 requests.

    Over the last ``window`` requests a decode node started answering, it is raised when no prefill node completed
    one of them and either the policy is ``always`` (every request was meant to cross) or at least one of them had a
    prompt longer than the local threshold (work a prefill node was there for). A policy that sends short prompts to
    the decode nodes, as it should, never raises it: their prompts are under the threshold. ``never`` with long
    prompts does: the prefill nodes then idle while the decode nodes prefill long prompts, which is what the alarm is
    for. Under ``window`` requests it stays 0 (too little traffic to tell)."""

    def __init__(self, settings: PolicySettings, window: int | None = None):
        self.settings, self.window = settings, window or settings.idle_window
        # bounded by the window actually used (the router passes none: the settings' idle_window); the scan at every
        # /metrics scrape reads at most that many
        self._entries: deque[list[bool]] = deque(maxlen=self.window)  # [long prompt, prefill completed]

    def entry(self, prompt_tokens: int) -> list[bool]:
        """A new attempt's entry: ``served`` marks it once its prefill node completed it; ``started`` counts it."""
        return [prompt_tokens > self.settings.local_prefill_max_tokens, False]

    @staticmethod
    def served(entry: list[bool]) -> None:
        entry[1] = True

    def started(self, entry: list[bool]) -> None:
        self._entries.append(entry)

    @property
    def alarm(self) -> bool:
        if len(self._entries) < self.window or any(served for _, served in self._entries):
            return False
        return self.settings.mode == "always" or any(long for long, _ in self._entries)
