"""On-device token sampling with per-row settings and per-row, counter-based randomness.

Every row of a batch carries its own temperature, top-k, top-p, min-p and random stream, as tensors, so one batched call
samples rows with different settings and no Python loop runs over rows.

Randomness. nanochat draws from one shared `torch.Generator`, so a row's tokens depend on how many rows share the
batch. Per-row `torch.Generator` objects would fix that but are a host loop per step. Instead each row gets a
32-bit key derived from `(seed, sample_index)`, and the uniform number it uses at a step is a hash of
`(key, counter)`, computed on the device, where `counter` is the number of tokens the row has emitted so far
(forced tokens included, so a fast-forwarded run consumes the same counters as the step-by-step path). A row's
draws therefore depend on nothing but its own seed, sample index and progress.

Sampling method: inverse CDF. One uniform per row picks the token whose cumulative probability (in vocabulary
order, over the tokens top-k/top-p keep) first exceeds `u * total`. It is exact, needs one hash per row per step
(the Gumbel-max alternative needs one per row *per vocabulary entry*), and walks the distribution in a fixed
order, so the result does not depend on which code path (sorted or not) selected the kept set.

Order of operations follows Hugging Face's warpers: temperature, then top-k, then top-p over the top-k survivors,
then min-p (which keeps a token at least `min_p` times as likely as the most likely one: a ratio that no earlier
truncation changes). Tokens tied with the k-th (or nucleus-boundary) logit are kept, so a tie can keep a few more
than k tokens. The penalties on repeats (`penalties.py`) come before all of them, on the raw logits, as in
transformers and llama.cpp; they apply to greedy rows too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from chatapp.settings import GenerationSettings

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """`x * constant mod 2**32` for int64 `x` in [0, 2**32), exact without int64 overflow on any backend.

    The constant is split into 16-bit halves so no partial product exceeds 2**49.
    """
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Chris Wellons' "lowbias32"): good avalanche, cheap, elementwise on any device."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    """`mix32` for one Python int (used to derive row keys on the host, once per request)."""
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def row_key(seed: int, sample_index: int) -> int:
    """The 32-bit random-stream key of a row: a hash of its seed (all 64 bits) and its sample index.

    Samples of one prompt share the seed but differ in `sample_index`, so `num_samples` rows give different
    samples, and the same (seed, sample) gives the same tokens in any batch.
    """
    seed &= (1 << 64) - 1
    key = _mix32_int(seed & _MASK32)
    key = _mix32_int(key ^ (seed >> 32))
    return _mix32_int(key ^ _mix32_int(sample_index + 0x9E3779B9))


def row_uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One float32 uniform in (0, 1) per row for draw number `counters[b]` of the stream `keys[b]`.

    24 hashed bits map to `(bits + 0.5) / 2**24`: exactly representable, never 0 or 1.
    """
    bits = mix32(keys ^ mix32(counters))
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


@dataclass(frozen=True)
class SamplingPlan:
    """Which stages any row of a batch needs, decided once per request on the host so the per-step code has no
    data-dependent branches: rows that do not need a stage pass through it unchanged."""

    any_sampling: bool  # some row has temperature > 0 (otherwise pure argmax)
    any_greedy: bool  # some row has temperature 0
    max_top_k: int  # largest top_k of a sampling row (0: no row uses top-k)
    any_top_p: bool  # some sampling row has top_p < 1
    any_min_p: bool  # some sampling row has min_p > 0
    top_p_within_top_k: bool  # every top-p row also has top-k, so the nucleus is found among max_top_k candidates


@dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling settings as device tensors (one entry per row of the device batch)."""

    temperature: torch.Tensor  # (B,) float32; 0 = greedy
    top_k: torch.Tensor  # (B,) int64; 0 = off
    top_p: torch.Tensor  # (B,) float32; 1 = off
    min_p: torch.Tensor  # (B,) float32; 0 = off
    keys: torch.Tensor  # (B,) int64 in [0, 2**32): random-stream key per row
    plan: SamplingPlan

    @classmethod
    def build(
        cls, settings: Sequence[GenerationSettings], sample_index: Sequence[int], device: torch.device
    ) -> SamplingParams:
        """Params for rows with the given settings and sample indices."""
        sampling = [s for s in settings if s.temperature > 0]
        top_p_rows = [s for s in sampling if s.top_p < 1]
        plan = SamplingPlan(
            any_sampling=bool(sampling),
            any_greedy=len(sampling) < len(settings),
            max_top_k=max((s.top_k for s in sampling), default=0),
            any_top_p=bool(top_p_rows),
            any_min_p=any(s.min_p > 0 for s in sampling),
            top_p_within_top_k=all(s.top_k > 0 for s in top_p_rows),
        )
        return cls(
            temperature=torch.tensor([s.temperature for s in settings], dtype=torch.float32, device=device),
            top_k=torch.tensor([s.top_k for s in settings], dtype=torch.long, device=device),
            top_p=torch.tensor([s.top_p for s in settings], dtype=torch.float32, device=device),
            min_p=torch.tensor([s.min_p for s in settings], dtype=torch.float32, device=device),
            keys=torch.tensor(
                [row_key(s.seed, i) for s, i in zip(settings, sample_index, strict=True)],
                dtype=torch.long,
                device=device,
            ),
            plan=plan,
        )

    def join(self, *others: SamplingParams) -> SamplingParams:
        """This batch's rows, then each of `others`' (rows admitted into a running batch); the plan covers all."""
        plans = [p.plan for p in (self, *others)]
        plan = SamplingPlan(
            any_sampling=any(p.any_sampling for p in plans),
            any_greedy=any(p.any_greedy for p in plans),
            max_top_k=max(p.max_top_k for p in plans),
            any_top_p=any(p.any_top_p for p in plans),
            any_min_p=any(p.any_min_p for p in plans),
            top_p_within_top_k=all(p.top_p_within_top_k for p in plans),
        )
        tensors = {
            f.name: torch.cat([getattr(p, f.name) for p in (self, *others)])
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, plan=plan, **tensors)

    def select(self, index: torch.Tensor) -> SamplingParams:
        """The params of rows `index` (batch compaction). The plan stays valid: it is an upper bound."""
        return replace(
            self,
            temperature=self.temperature.index_select(0, index),
            top_k=self.top_k.index_select(0, index),
            top_p=self.top_p.index_select(0, index),
            min_p=self.min_p.index_select(0, index),
            keys=self.keys.index_select(0, index),
        )


def sample(logits: torch.Tensor, params: SamplingParams, counters: torch.Tensor) -> torch.Tensor:
    """Next token per row (B,) from `logits` (B, V): greedy rows take the argmax, others sample per their settings.

    `counters` (B,) int64 is each row's draw number (tokens it emitted so far). No host synchronisation.
    """
    return _draw(logits, params, counters, with_log_probs=False)[0]


def sample_with_log_probs(
    logits: torch.Tensor, params: SamplingParams, counters: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample`, plus the (B, V) log-probabilities of the distribution each row drew from: temperature, top-k and
    top-p applied to `logits` (which already carry the grammar mask). A greedy row's distribution is its argmax
    alone: 0 there, -inf elsewhere. Same tokens as `sample`: the draw is computed once and shared."""
    tokens, log_probs = _draw(logits, params, counters, with_log_probs=True)
    assert log_probs is not None
    return tokens, log_probs


def _draw(
    logits: torch.Tensor, params: SamplingParams, counters: torch.Tensor, *, with_log_probs: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    greedy = logits.argmax(dim=-1)
    if not params.plan.any_sampling:
        return greedy, _point_mass(greedy, logits) if with_log_probs else None
    temperature = params.temperature
    is_greedy = temperature <= 0
    scaled = logits.float() / torch.where(is_greedy, 1.0, temperature)[:, None]
    allowed = _allowed_tokens(scaled, params)
    masked = scaled.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(masked, dim=-1)
    drawn = inverse_cdf(probs, row_uniforms(params.keys, counters))
    tokens = torch.where(is_greedy, greedy, drawn)
    if not with_log_probs:
        return tokens, None
    # The log-probabilities just drawn from. log_softmax of the masked logits, not `probs.log()`: on a CPU the log
    # of the many exact zeros top-k/top-p leave is the slower pass (measured 0.5 vs 0.2 ms at V = 49,152).
    log_probs = torch.log_softmax(masked, dim=-1)
    if params.plan.any_greedy:
        log_probs = torch.where(is_greedy[:, None], _point_mass(greedy, logits), log_probs)
    return tokens, log_probs


def _point_mass(tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """(B, V) float32 log-probabilities of a distribution that is certain of `tokens` (B,)."""
    log_probs = torch.full(logits.shape, float("-inf"), dtype=torch.float32, device=logits.device)
    return log_probs.scatter_(1, tokens[:, None], 0.0)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability exceeds `u * total`, per row; never a zero-probability token.

    `u * total` is clamped just below `total`, so the search always lands on a token whose own probability is
    positive (`cdf[i] > target >= cdf[i-1]`), whatever the rounding of the cumulative sum.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)


def _allowed_tokens(scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(B, V) bool: the tokens top-k, top-p and min-p keep for each row (everything for rows that use none)."""
    plan = params.plan
    neg_inf = float("-inf")  # a Python scalar: no host-to-device copy per step
    threshold = torch.full((scaled.shape[0],), float("-inf"), device=scaled.device)
    candidates = None
    if plan.max_top_k > 0:
        kmax = min(plan.max_top_k, scaled.shape[-1])
        candidates = scaled.topk(kmax, dim=-1).values  # sorted, descending
        k = params.top_k.clamp(1, kmax)
        kth = candidates.gather(1, (k - 1)[:, None]).squeeze(1)
        threshold = torch.where(params.top_k > 0, kth, neg_inf)
        # Candidates beyond a row's own k are not part of its distribution.
        ranks = torch.arange(kmax, device=scaled.device)
        candidates = candidates.masked_fill((ranks[None, :] >= k[:, None]) | (params.top_k <= 0)[:, None], neg_inf)
    if plan.any_top_p:
        if candidates is None or not plan.top_p_within_top_k:
            ordered = scaled.masked_fill(scaled < threshold[:, None], neg_inf).sort(dim=-1, descending=True)
            candidates = ordered.values
        nucleus = _nucleus_threshold(candidates, params.top_p)
        threshold = torch.where(params.top_p < 1, torch.maximum(threshold, nucleus), threshold)
    if plan.any_min_p:
        # p >= min_p * p_max  <=>  logit >= max logit + log(min_p); log(0) = -inf keeps everything.
        floor = scaled.amax(dim=-1) + params.min_p.log()
        threshold = torch.maximum(threshold, floor)
    return scaled >= threshold[:, None]


def _nucleus_threshold(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Smallest logit inside each row's nucleus: the shortest prefix of the descending candidates whose
    probability mass reaches `top_p` (the first token always stays)."""
    probs = torch.softmax(sorted_logits, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each candidate
    keep = before < top_p[:, None]
    keep[:, 0] = True
    count = keep.sum(dim=-1)
    return sorted_logits.gather(1, (count - 1)[:, None]).squeeze(1)
