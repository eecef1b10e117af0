"""Per-request generation settings."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from functools import cached_property

from specdec.engine.structured_output import StructuredOutput


# below this, logits / temperature overflows float32 for ordinary logits: use 0 for greedy instead
MIN_TEMPERATURE = 1e-5
# above this, sampling is uniform over the vocabulary to within float32 rounding: a value past it is a mistake
MAX_TEMPERATURE = 100.0
# stop strings are matched against the text after every committed token: bounded like vLLM's and OpenAI's
# limits (OpenAI takes 4), so one request cannot slow everyone's steps
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 64  # token ids that end an answer besides the model's end of sequence (vLLM's stop_token_ids)
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
MAX_SAMPLES = 64  # answers per prompt (n)
MAX_LOGIT_BIAS = 300  # token ids one logit_bias may name (OpenAI's limit)
MAX_REPETITION_PENALTY = 10.0


def is_int(value) -> bool:
    """An integer (not a bool, which Python counts as one). Shared by every check of user-given settings."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A finite real number (not a bool, not inf or nan)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    # drop tokens less likely than min_p times the likeliest one (after top-k and top-p, as transformers orders
    # them; vLLM's and llama.cpp's min_p); 0 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    ignore_eos: bool = False
    # token ids that end the answer as the model's end-of-sequence ids do (also with ignore_eos; the token is the
    # answer's last), and the output tokens before which neither those nor end-of-sequence ids can be sampled
    # (vLLM's stop_token_ids and min_tokens; stop strings still apply)
    stop_token_ids: tuple[int, ...] | None = None
    min_tokens: int = 0
    # the text: special tokens left out of it (as vLLM's skip_special_tokens), and a matched stop string kept at
    # its end (vLLM's include_stop_str_in_output); token ids are the same either way
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    chat: bool = False  # apply the tokenizer's chat template to string prompts
    # the target's log-probability of each generated token and of its `logprobs` most likely alternatives
    # (0 to 20); None: none
    logprobs: int | None = None
    # answers per prompt: n requests of one prompt, sample j seeded with seed + j (when seeded); they share
    # the prompt's prefill through the prefix cache
    n: int = 1
    # the target's log-probability of each prompt token after the first, and of its `prompt_logprobs` most
    # likely alternatives (0 to 20; the API's echo + logprobs); None: none. Such a request prefills its whole
    # prompt (no prefix cache hit), in chunks of at most 512 tokens
    prompt_logprobs: int | None = None
    # penalties and bias on the target's logits (specdec/engine/penalties.py): presence and frequency as
    # OpenAI's ([-2, 2]), repetition as vLLM's (1 = off; > 1 discourages repeats), logit_bias {token id: bias}
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # what the output must match: a JSON schema, any JSON object, a regex, a choice or a grammar
    # (specdec/engine/structured_output.py); the target's logits are masked at every verified position
    structured_output: StructuredOutput | None = None

    def __post_init__(self):
        problems = []
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        elif stop is not None:
            try:
                stop = tuple(stop)
            except TypeError:
                problems.append(f"stop must be a string or a list of strings, got {stop!r}")
                stop = None
        object.__setattr__(self, "stop", stop)
        stop_ids = self.stop_token_ids
        if stop_ids is not None and not isinstance(stop_ids, (str, bytes)):
            try:
                stop_ids = tuple(stop_ids)
            except TypeError:
                pass
        object.__setattr__(self, "stop_token_ids", stop_ids)
        if stop_ids is not None and (not isinstance(stop_ids, tuple) or len(stop_ids) > MAX_STOP_TOKEN_IDS
                                     or not all(is_int(t) and t >= 0 for t in stop_ids)):
            problems.append(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids (integers >= 0), "
                            f"got {_shown(self.stop_token_ids)}")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= (
                self.max_new_tokens if is_int(self.max_new_tokens) else 0):
            problems.append(f"min_tokens must be an integer in [0, max_new_tokens], got {self.min_tokens!r}")
        if not is_real(self.temperature) or not (
                self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            problems.append(f"temperature must be 0 (greedy) or a number in [{MIN_TEMPERATURE:g}, "
                            f"{MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            problems.append(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not is_real(self.min_p) or not 0 <= self.min_p <= 1:
            problems.append(f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            problems.append(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if stop is not None and any(not isinstance(s, str) or not s for s in stop):
            problems.append(f"stop must be non-empty strings, got {_shown(stop)}")
        elif stop is not None and (len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop)):
            problems.append(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters, "
                            f"got {len(stop)} of up to {max(map(len, stop))}")
        for name in ("ignore_eos", "chat", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            problems.append(f"logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}] (the alternatives per "
                            f"token), got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_real(value) or not -2 <= value <= 2:
                problems.append(f"{name} must be a number in [-2, 2], got {value!r}")
        if not is_real(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            problems.append(f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), got "
                            f"{self.repetition_penalty!r}")
        bias = self.logit_bias
        if bias is not None and (not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS or not all(
                is_int(k) and k >= 0 and is_real(v) and -100 <= v <= 100 for k, v in bias.items())):
            problems.append(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids (integers >= 0) to numbers in "
                            f"[-100, 100], got {_shown(bias)}")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS):
            problems.append(f"prompt_logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], got "
                            f"{self.prompt_logprobs!r}")
        if not is_int(self.n) or not 1 <= self.n <= MAX_SAMPLES:
            problems.append(f"n must be an integer in [1, {MAX_SAMPLES}], got {self.n!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            problems.append(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            problems.append(f"structured_output must be a StructuredOutput, got {type(self.structured_output).__name__}")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

    # the derived flags below are cached (settings never change): the engine asks them of every request at every step

    @cached_property
    def greedy(self) -> bool:
        return self.temperature == 0

    @cached_property
    def penalized(self) -> bool:
        """Penalties, a logit bias or min_tokens on the target's logits (specdec/engine/penalties.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @cached_property
    def adjusts_logits(self) -> bool:
        """Whether the request's rows are reshaped before sampling (penalties, logit bias, structured output): they
        depend on its output so far, which the host holds, so its steps run in order and verify chains."""
        return self.penalized or self.structured_output is not None

    def for_sample(self, j: int) -> SamplingParams:
        """The settings of answer j of n: one answer, seeded with seed + j (mod 2**63) when seeded."""
        return replace(self, n=1, seed=None if self.seed is None else (self.seed + j) % 2**63)


def _shown(value, limit: int = 200) -> str:
    """repr(value), cut to `limit` characters (an error message must not echo a huge input back)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
