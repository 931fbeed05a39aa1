"""What the model thought of each emitted token: log-probability, entropy and the top-N alternatives.

Asked for per row with `GenerationSettings.logprobs = N` (0 = off). The decode loop measures on the device, in the
step it already runs, and the results ride in the step's one device→host copy; nothing here synchronises.

    logits before any mask ─► log_softmax ─► the emitted token's log p, entropy, top-N     (the model's view)
    the sampling distribution (`sampling.sample_with_log_probs`) ─► log p, top-N              (what was drawn from)

A step emits up to W tokens per row (W > 1 when a row fast-forwards a known run). Token 0 of a row is predicted by
the logits the previous forward left (`DeviceBatch.logits`); token j > 0 of a fast-forwarded run by the run's own
forward at position j - 1, which the loop asks for (`extend(all_logits=True)`) only when log-probs are on. So every
emitted token, forced ones included, has the model's numbers; only token 0 can have been sampled, so only it has
sampling numbers. `TokenLogprobs` (events.py) says what each number means.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from chatapp.engine.events import Alternative, TokenLogprobs


@dataclass(frozen=True)
class LogprobTensors:
    """One step's measurements on the device: (B, W) per emitted position, (B,) / (B, N) for the sampled one."""

    chosen: torch.Tensor  # (B, W) model log p of each fed token
    entropy: torch.Tensor  # (B, W) nats
    top_logprobs: torch.Tensor  # (B, W, N) descending
    top_ids: torch.Tensor  # (B, W, N)
    sampling_chosen: torch.Tensor  # (B,) sampling-distribution log p of token 0
    sampling_logprobs: torch.Tensor  # (B, N) descending; -inf past the tokens it allows
    sampling_ids: torch.Tensor  # (B, N)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.chosen,
            self.entropy,
            self.top_logprobs,
            self.top_ids,
            self.sampling_chosen,
            self.sampling_logprobs,
            self.sampling_ids,
        )


def model_log_probs(logits: torch.Tensor) -> torch.Tensor:
    """The model's distribution: log-softmax of raw logits (temperature 1), in float32 whatever the model's dtype."""
    return torch.log_softmax(logits.float(), dim=-1)


def measure(
    model: torch.Tensor, fed: torch.Tensor, sampling: torch.Tensor, top_n: int
) -> LogprobTensors:
    """`model` (B, W, V): the model's log-probs for each emitted position; `fed` (B, W): the tokens emitted there;
    `sampling` (B, V): the log-probs token 0 was drawn with; `top_n` alternatives per token."""
    top = model.topk(min(top_n, model.shape[-1]), dim=-1)
    sampling_top = sampling.topk(min(top_n, sampling.shape[-1]), dim=-1)
    return LogprobTensors(
        chosen=model.gather(-1, fed[..., None]).squeeze(-1),
        # -sum p log p from the log-probs at hand (one exp, no second log). A logit of -inf gives 0 * -inf = nan,
        # which nansum counts as 0: the limit of p log p at p = 0.
        entropy=-torch.nansum(model.exp() * model, dim=-1),
        top_logprobs=top.values,
        top_ids=top.indices,
        sampling_chosen=sampling.gather(-1, fed[:, :1]).squeeze(-1),
        sampling_logprobs=sampling_top.values,
        sampling_ids=sampling_top.indices,
    )


@dataclass
class HostLogprobs:
    """`LogprobTensors` on the host, as nested lists indexed [row][position]..."""

    chosen: list[list[float]]
    entropy: list[list[float]]
    top_logprobs: list[list[list[float]]]
    top_ids: list[list[list[int]]]
    sampling_chosen: list[float]
    sampling_logprobs: list[list[float]]
    sampling_ids: list[list[int]]

    @classmethod
    def unpack(cls, take: Callable[..., torch.Tensor], rows: int, width: int, top_n: int) -> HostLogprobs:
        """Read the fields in `LogprobTensors.tensors()` order from the step's packed copy (`take(*shape)`)."""
        return cls(
            chosen=take(rows, width).tolist(),
            entropy=take(rows, width).tolist(),
            top_logprobs=take(rows, width, top_n).tolist(),
            top_ids=take(rows, width, top_n).long().tolist(),
            sampling_chosen=take(rows).tolist(),
            sampling_logprobs=take(rows, top_n).tolist(),
            sampling_ids=take(rows, top_n).long().tolist(),
        )

    def token(
        self, row: int, position: int, token: int, top_n: int, drawn: bool, piece: Callable[[int], bytes]
    ) -> TokenLogprobs:
        """The numbers of `token`, emitted at `position` of device row `row`, with that row's own `top_n`
        alternatives; `drawn`: it was sampled (not forced), so the sampling distribution's numbers apply."""

        def alternatives(ids: list[int], logprobs: list[float]) -> tuple[Alternative, ...]:
            return tuple(
                Alternative(token, piece(token), logprob)
                for token, logprob in zip(ids[:top_n], logprobs[:top_n], strict=True)
                if logprob > float("-inf")
            )

        sampled = drawn and position == 0
        return TokenLogprobs(
            logprob=self.chosen[row][position],
            piece=piece(token),
            # Rounding can leave a hair below 0 for a near-certain distribution.
            entropy=max(self.entropy[row][position], 0.0),
            top=alternatives(self.top_ids[row][position], self.top_logprobs[row][position]),
            sampling_logprob=self.sampling_chosen[row] if sampled else None,
            sampling_top=alternatives(self.sampling_ids[row], self.sampling_logprobs[row]) if sampled else (),
        )
