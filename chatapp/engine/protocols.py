"""What the engine needs from the objects it is handed: the model, its KV cache, the chat format, a constraint.

The engine sits below `chat` and takes models from `stt` (or test doubles with the same interface), so it names
these shapes instead of importing the classes. `chatapp.stt.STTForCausalLM` / `KVCache`, `chatapp.chat.ChatFormat`
/ `TemplateChatFormat` and `chatapp.trie.constraint.Constraint` satisfy them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch


class ChatFormatLike(Protocol):
    """What the engine needs from `chatapp.chat.ChatFormat` / `TemplateChatFormat`."""

    supports_tools: bool
    assistant_end_id: int | None
    program_aliases: dict[str, str]  # nanochat token names -> this format's (for TTFA programs)
    stop_token_ids: tuple[int, ...]

    def encode_text(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def render_conversation(
        self, messages: Sequence[Any], max_tokens: int | None = None
    ) -> tuple[list[int], list[int]]: ...
    def render_for_completion(self, messages: Sequence[Any]) -> list[int]: ...


class ForwardOutput(Protocol):
    """One `extend` / `decode` call's results, all on the model's device."""

    logits: torch.Tensor  # (B, V) after each row's last new token; (B, T, V) from `extend(all_logits=True)`
    router_probs: torch.Tensor  # (L_stt, B, T) causal-router probabilities
    selected: torch.Tensor  # (L_stt, B, T) bool: the STT layer computed this token
    states: torch.Tensor | None  # (L, B, D) every layer's output at each row's last new token, when captured


class KVCacheLike(Protocol):
    """A batch's KV cache: grows on demand, drops rows, gives one row as a cache of its own (views), and marks /
    restores a point for chat sessions."""

    max_len: int  # slots per row
    host_bound: int  # host-side upper bound on any row's length (no device read needed)

    def grow(self, new_max_len: int) -> None: ...
    def select_rows(self, index: torch.Tensor) -> KVCacheLike: ...
    def row(self, index: int) -> KVCacheLike: ...
    def join(self, *others: Any) -> KVCacheLike: ...
    def mark(self) -> Any: ...
    def restore(self, mark: Any) -> None: ...


class ModelConfigLike(Protocol):
    num_hidden_layers: int
    max_position_embeddings: int
    vocab_size: int


class ModelLike(Protocol):
    """The model the engine drives (`chatapp.stt.STTForCausalLM`): ragged `extend` (prefill), one-token `decode`
    and the ragged decode step `feed`."""

    config: Any  # a ModelConfigLike; typed loosely because transformers' configs declare these dynamically

    @property
    def stt_layer_indices(self) -> list[int]: ...
    @property
    def device(self) -> torch.device: ...

    def new_cache(self, batch_size: int, max_len: int) -> KVCacheLike: ...
    def extend(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        cache: KVCacheLike,
        *,
        routing: str = "student",
        threshold: float | None = None,
        all_logits: bool = False,
        capture: str | None = None,
    ) -> ForwardOutput: ...
    def decode(
        self,
        ids: torch.Tensor,
        cache: KVCacheLike,
        *,
        routing: str = "student",
        threshold: float | None = None,
        active: torch.Tensor | None = None,
        capture: bool = False,
    ) -> ForwardOutput: ...
    def feed(
        self,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        cache: KVCacheLike,
        *,
        routing: str = "student",
        threshold: float | None = None,
        all_logits: bool = False,
    ) -> ForwardOutput: ...


class ConstraintLike(Protocol):
    """A row's grammar state (`chatapp.trie.constraint.Constraint`)."""

    def ff_tokens(self) -> list[int]: ...
    def consume(self, token: int) -> None: ...
