"""Per-request sampling parameters (vLLM names and defaults).

`SamplingParams.__post_init__` normalizes and validates every field and raises `ValueError`
with a precise message on bad input. `to_dict()` / `from_dict()` give a JSON-friendly form.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from typing import Any

from .structured_params import StructuredOutputsParams

# temperatures below this are treated as greedy (float noise around 0)
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20
# Bounds inside which no parameter can push a float32 logit to inf or nan (logits are at most a few
# hundred in magnitude: x / 0.01 and x * 100 stay far below 3e38), nor ask for absurd work. The
# wire schema (schemas/request.py) uses the same numbers.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_TEMPERATURE = 100.0
MAX_N = 128
MAX_STOP_LEN = 1024  # characters per stop string (checked against the text every token)
MAX_STOP_STRINGS = 64
# seeds are int64, as OpenAI's and vLLM's: [MIN_SEED, MAX_SEED); engine/randomness.py keys its
# draws on the seed's 64 bits, so every seed in range draws its own stream
MIN_SEED, MAX_SEED = -(2**63), 2**63
MAX_LOGIT_BIAS = 1024  # token ids one request may bias (OpenAI caps the value, not the count)
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: -100 bans a token, +100 all but forces it
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = field(default_factory=list)
    stop_token_ids: list[int] | None = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # the prompt's own log-probabilities (vLLM's name): per prompt token after the first, its
    # logprob and the top `prompt_logprobs` alternatives, computed in the prefill the request runs
    # anyway (RequestOutput.prompt_logprobs); with it, max_tokens may be 0 (score, generate nothing)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None  # engine/structured_params.py
    # {token id: added to its logit}, after the penalties and before temperature (OpenAI's)
    logit_bias: dict[int, float] | None = None
    # speculative (n-gram) decoding for this request: None as the engine is configured, False
    # never, True even on an engine without a speculative config (engine/speculative.py)
    speculative: bool | None = None

    def __post_init__(self) -> None:
        self._check_types()
        self._normalize()
        self._check_ranges()
        for name in _FLOAT_FIELDS:  # ints are fine on input; store floats
            setattr(self, name, float(getattr(self, name)))

    # ---- validation -------------------------------------------------------------------------
    def _check_types(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an int, got {getattr(self, name)!r}")
        for name in _FLOAT_FIELDS:
            v = getattr(self, name)
            if not _is_num(v) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not _is_int(v):
                raise ValueError(f"{name} must be an int or None, got {v!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.speculative is not None and not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be a bool or None, got {self.speculative!r}")

    def _normalize(self) -> None:
        if self.top_k == 0:
            self.top_k = -1  # 0 and -1 both mean "disabled"
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)):
            stop = list(stop)
        else:
            raise ValueError(f"stop must be a str or a list of str, got {type(stop).__name__}")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
            if len(s) > MAX_STOP_LEN:
                raise ValueError(f"stop strings must be at most {MAX_STOP_LEN} characters, got "
                                 f"{len(s)}")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        self.stop = stop
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {ids!r}")
        self.stop_token_ids = list(ids)
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        self.logit_bias = _logit_bias(self.logit_bias)

    def _check_ranges(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {self.n}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature > MAX_TEMPERATURE:
            raise ValueError(f"temperature must be <= {MAX_TEMPERATURE:g}, got {self.temperature}")
        if self.seed is not None and not MIN_SEED <= self.seed < MAX_SEED:
            raise ValueError(f"seed must be a 64-bit signed int, in [-2**63, 2**63), got {self.seed}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, "
                             f"{MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if self.max_tokens is not None and self.max_tokens < (0 if self.prompt_logprobs is not None
                                                              else 1):
            raise ValueError(f"max_tokens must be at least 1 (0 only with prompt_logprobs), got "
                             f"{self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens}"
                             f", max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {v}")

    # ---- derived ----------------------------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def needs_processing(self) -> bool:
        """Anything that changes the logits before the argmax (a greedy row with none of it
        takes the batched argmax)."""
        return self.has_penalties or bool(self.logit_bias)

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    # ---- (de)serialization ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["logit_bias"] = dict(self.logit_bias) if self.logit_bias else None
        if self.structured_outputs is not None:
            out["structured_outputs"] = self.structured_outputs.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        if not isinstance(data, dict):
            raise ValueError(f"SamplingParams.from_dict wants a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown SamplingParams field(s): {', '.join(unknown)}")
        return cls(**data)

    def clone(self, **changes: Any) -> "SamplingParams":
        d = self.to_dict()
        d.update(changes)
        return SamplingParams.from_dict(d)


def _logit_bias(bias: Any) -> dict[int, float] | None:
    """{token id: bias} with int ids (JSON gives them as strings) and finite values in
    [-100, 100]; None for none. The engine checks the ids against its vocabulary."""
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be an object of token id -> bias, got "
                         f"{type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
    out: dict[int, float] = {}
    for k, v in bias.items():
        tid = k if _is_int(k) else int(k) if isinstance(k, str) and k.isascii() and k.isdigit() \
            else None
        if tid is None or tid < 0:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got "
                             f"{k!r}")
        if not _is_num(v) or not -LOGIT_BIAS_RANGE <= v <= LOGIT_BIAS_RANGE:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {v!r} "
                             f"for token {tid}")
        out[tid] = float(v)
    return out

