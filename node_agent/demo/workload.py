"""A synthetic engine workload: multi-turn conversations that share system prompts.

Every conversation starts with one of ``shared_prefixes`` system prompts; each turn
appends a user message, and after the turn the model's reply joins the history.
Turn ``k`` of a conversation therefore repeats turn ``k-1`` as its prefix, which is
what a KV cache turns into saved prefill. Requests are interleaved across
conversations (turn 0 of every conversation, then turn 1, ...), as a server sees
them. Token ids and KV contents are pure functions of the spec, so every PP stage
of a group generates the same requests and can check loaded KV bit-exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch


@dataclass(frozen=True)
class WorkloadSpec:
    """Size of the synthetic workload."""

    conversations: int = 12
    turns: int = 4
    shared_prefixes: int = 2
    system_tokens: int = 512
    user_tokens: int = 96
    reply_tokens: int = 64
    vocab: int = 32000
    seed: int = 0

    @property
    def requests(self) -> int:
        """Number of requests the workload issues."""
        return self.conversations * self.turns

    @property
    def max_tokens(self) -> int:
        """Tokens of the longest request including its reply."""
        return self.system_tokens + self.turns * (self.user_tokens + self.reply_tokens)


@dataclass(frozen=True)
class DemoRequest:
    """One engine request: ``prompt`` is looked up; ``prompt + reply`` is stored."""

    rid: str
    conversation: int
    turn: int
    prompt: npt.NDArray[np.int64]
    reply: npt.NDArray[np.int64]

    @property
    def full(self) -> npt.NDArray[np.int64]:
        """Prompt followed by the reply (what the engine stores after decoding)."""
        return np.concatenate([self.prompt, self.reply])


def generate(spec: WorkloadSpec) -> Iterator[DemoRequest]:
    """The workload's requests in arrival order."""
    rng = np.random.default_rng(spec.seed)
    prefixes = [rng.integers(0, spec.vocab, spec.system_tokens, dtype=np.int64)
                for _ in range(spec.shared_prefixes)]
    history = [prefixes[c % spec.shared_prefixes].copy() for c in range(spec.conversations)]
    for turn in range(spec.turns):
        for conv in range(spec.conversations):
            user = rng.integers(0, spec.vocab, spec.user_tokens, dtype=np.int64)
            reply = rng.integers(0, spec.vocab, spec.reply_tokens, dtype=np.int64)
            prompt = np.concatenate([history[conv], user])
            yield DemoRequest(rid=f"c{conv}-t{turn}", conversation=conv, turn=turn,
                              prompt=prompt, reply=reply)
            history[conv] = np.concatenate([prompt, reply])


def kv_values(tokens: npt.NDArray[np.int64], start: int, plane: int,
              dtype: torch.dtype) -> torch.Tensor:
    """The KV one plane holds for ``tokens`` at positions ``start...``: a function of
    token id, position and plane, standing in for what prefill computes."""
    pos = np.arange(start, start + len(tokens), dtype=np.int64)
    vals = ((tokens * 31 + pos * 7 + plane * 13) % 1021).astype(np.float32) / 4.0
    return torch.from_numpy(vals).to(dtype)
