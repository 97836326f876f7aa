"""Greedy ``/v1/completions`` client: one request, or a prompt list with requests in flight.

Every request asks for temperature 0, ``ignore_eos`` and ``return_token_ids``, so a run yields
exactly ``max_tokens`` token ids per prompt to compare token for token (:mod:`.parity`). Needs the
``demo`` extra (``requests``), imported where used.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Completion:
    """One greedy completion: generated token ids and text, and the request's wall time."""

    prompt: str
    text: str
    token_ids: tuple[int, ...]
    elapsed_s: float


class CompletionError(RuntimeError):
    """A completion request failed (HTTP error, bad payload or missing token ids)."""


class CompletionTimeoutError(CompletionError):
    """A completion request got no answer within its timeout (the server may hang)."""


def served_model_id(base_url: str, timeout_s: float = 10.0) -> str:
    """The first model id listed by ``GET /v1/models``."""
    import requests

    resp = requests.get(f"{base_url}/v1/models", timeout=timeout_s)
    resp.raise_for_status()
    data = resp.json()["data"]
    if not data:
        raise CompletionError(f"{base_url}/v1/models lists no model")
    model_id: str = data[0]["id"]
    return model_id


def complete(
    base_url: str,
    prompt: str,
    *,
    model: str,
    max_tokens: int = 16,
    timeout_s: float = 300.0,
) -> Completion:
    """Greedy ``/v1/completions`` (temperature 0, EOS ignored so exactly ``max_tokens`` come)."""
    import requests

    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r} must be >= 1")
    payload: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    t0 = time.monotonic()
    try:
        resp = requests.post(f"{base_url}/v1/completions", json=payload, timeout=timeout_s)
    except requests.Timeout as e:
        raise CompletionTimeoutError(f"{base_url} did not answer within {timeout_s}s") from e
    except requests.RequestException as e:
        raise CompletionError(f"request to {base_url} failed: {e}") from e
    elapsed = time.monotonic() - t0
    if resp.status_code != 200:
        raise CompletionError(f"{base_url} answered {resp.status_code}: {resp.text[:500]}")
    choice = resp.json()["choices"][0]
    ids = choice.get("token_ids")
    if ids is None:
        raise CompletionError(f"{base_url} returned no token_ids (return_token_ids unsupported?)")
    return Completion(prompt, choice["text"], tuple(int(i) for i in ids), elapsed)


@dataclass(frozen=True)
class BatchResult:
    """Completions for a prompt list (in prompt order) and the batch's wall time."""

    completions: tuple[Completion, ...]
    wall_s: float

    @property
    def generated_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.completions)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0


def complete_many(
    base_url: str,
    prompts: Sequence[str],
    *,
    model: str | None = None,
    max_tokens: int = 16,
    concurrency: int = 4,
    timeout_s: float = 300.0,
) -> BatchResult:
    """Send ``prompts`` with up to ``concurrency`` requests in flight; results keep prompt order."""
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency!r} must be >= 1")
    model_id = model or served_model_id(base_url)
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [
            pool.submit(
                complete, base_url, p, model=model_id, max_tokens=max_tokens, timeout_s=timeout_s
            )
            for p in prompts
        ]
        completions = tuple(f.result() for f in futures)
    return BatchResult(completions, time.monotonic() - t0)
