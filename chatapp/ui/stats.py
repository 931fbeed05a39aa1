"""Running statistics of one answer, shown in the side panel.

Speed comes from the engine's own per-step timings (`Step.seconds`), not from the wall clock, so the figure is the
model's decode speed and is reproducible in tests with a scripted backend.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from chatapp.engine.events import Step, TokenEvent


@dataclass
class AnswerStats:
    """Counters for the answer being generated (or the last one)."""

    num_layers: int = 0  # all transformer layers of the model: the denominator of "compute saved"
    tokens: int = 0
    forced: int = 0
    seconds: float = 0.0
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    context_used: int = 0
    context_size: int = 0
    # STT routing over the generated tokens that went through the model: (token, STT layer) blocks computed.
    routed_tokens: int = 0
    stt_blocks: int = 0
    computed_blocks: int = 0

    def add_step(self, step: Step, events: Iterable[TokenEvent]) -> None:
        """Account one Step; `events` are the step's tokens for the row on screen."""
        if step.prompt is not None:
            info = step.prompt
            self.prompt_tokens = info.prompt_tokens[0] if info.prompt_tokens else 0
            self.prefill_seconds = info.prefill_seconds
            self.context_used = info.context_used[0] if info.context_used else self.prompt_tokens
            self.context_size = info.context_size
        self.seconds += step.seconds
        for event in events:
            self.tokens += 1
            self.forced += event.forced
            # Every emitted token but a final stop token (never fed to the model) now occupies the context.
            if event.finish_reason is None or event.computed is not None:
                self.context_used += 1
            if event.computed is not None:
                self.routed_tokens += 1
                self.stt_blocks += len(event.computed)
                self.computed_blocks += sum(event.computed)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def forced_fraction(self) -> float:
        return self.forced / self.tokens if self.tokens else 0.0

    @property
    def stt_skipped_fraction(self) -> float:
        """Share of (token, STT layer) blocks the routers skipped."""
        return 1 - self.computed_blocks / self.stt_blocks if self.stt_blocks else 0.0

    @property
    def compute_saved_fraction(self) -> float:
        """Share of all (token, layer) blocks skipped: the layer compute saved, ignoring embeddings and LM head."""
        total = self.routed_tokens * self.num_layers
        return (self.stt_blocks - self.computed_blocks) / total if total else 0.0
