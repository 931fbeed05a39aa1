"""The per-layer sparse KV cache of the STT model.

Every layer has its own `(B, max_len + 1, H_kv, D)` key and value storage and its own per-row entry count:
dense layers append every token, STT layers only the tokens they selected in "strict" skip mode (every token in
"kv" mode, where a skipped token still stores its K/V), so rows and layers fill at different rates. Each entry
records the absolute position of its token, and a query at position p may see exactly the entries of its row with position <= p; rotary embeddings use that absolute position, never the slot index.

Slot `max_len` is a write-only trash slot: padding tokens and unselected tokens are written there, which keeps
every write a single `index_put_` without data-dependent shapes (and so without host syncs).

The cache also keeps a host-side upper bound on how many tokens any row has seen. Attention reads only the
first `bound` slots, and the overflow check only needs the device when the bound says a row *might* overflow.
Because the bound grows by the (host-known) chunk width on every call, decode never waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chatapp.errors import ContextOverflowError


def attention_dtype(kv_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention sums in over a cache of `kv_dtype`: float32 for a float16 cache on a CPU (the native
    step's, `STTForCausalLM.kv_dtype`: stored in half the bytes, read back exactly and summed in float32, as that
    step does; torch's CPU attention in half precision is slower and rounds its partial sums), else the cache's."""
    return torch.float32 if kv_dtype == torch.float16 and device.type == "cpu" else kv_dtype


def attention_inputs(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached keys and values as attention reads them (`attention_dtype`)."""
    dtype = attention_dtype(keys.dtype, keys.device)
    return keys.to(dtype), values.to(dtype)


@dataclass(frozen=True)
class CacheMark:
    """A cheap snapshot of a cache's bookkeeping; K/V past the restored lengths is simply dead."""

    lengths: torch.Tensor
    seen: torch.Tensor
    prev_hidden: torch.Tensor
    host_bound: int


class KVCache:
    """Per-layer K/V storage with per-row, per-layer lengths, absolute entry positions and router state."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_stt_layers: int,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        hidden_size: int,
        device: torch.device | str,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """`dtype` is the activations' (the routers' stored x_{t-1}); `kv_dtype` the keys' and values', `dtype` by
        default."""
        if max_len < 1 or batch_size < 0:
            raise ValueError(f"bad cache shape: batch_size={batch_size}, max_len={max_len}")
        self.max_len = max_len
        self.batch_size = batch_size
        shape = (batch_size, max_len + 1, num_kv_heads, head_dim)
        kv_dtype = kv_dtype or dtype
        # One block per kind, each layer a view of it: the int8 CPU step reads every layer from one array.
        self.keys = list(torch.zeros((num_layers, *shape), device=device, dtype=kv_dtype).unbind(0))
        self.values = list(torch.zeros((num_layers, *shape), device=device, dtype=kv_dtype).unbind(0))
        # Absolute position of every entry (trash slot included); int32 keeps the mask inputs small.
        self.positions = torch.zeros(num_layers, batch_size, max_len + 1, device=device, dtype=torch.int32)
        self.lengths = torch.zeros(num_layers, batch_size, device=device, dtype=torch.long)
        self.seen = torch.zeros(batch_size, device=device, dtype=torch.long)
        # Per STT layer, the previous token's layer input: the causal router's x_{t-1} (zeros at the start).
        self.prev_hidden = torch.zeros(num_stt_layers, batch_size, hidden_size, device=device, dtype=dtype)
        self.host_bound = 0
        # The native decode step's (L, B, S + 1, H_kv, Dh) views of keys and values (`stt.cpu_step.cache_arrays`),
        # with the identities of the lists they were made from.
        self.native_views: tuple | None = None

    # ----------------------------------------------------------------------------------------------- properties
    @property
    def kv_dtype(self) -> torch.dtype:
        return self.keys[0].dtype if self.keys else self.prev_hidden.dtype

    @property
    def attention_dtype(self) -> torch.dtype:
        return attention_dtype(self.kv_dtype, self.device)

    @property
    def device(self) -> torch.device:
        return self.seen.device

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def layer_lengths(self, layer: int) -> torch.Tensor:
        """Entries per row (B,) stored for `layer`."""
        return self.lengths[layer]

    # ----------------------------------------------------------------------------------------------- bookkeeping
    def reserve(self, lengths: torch.Tensor | int, width: int) -> int:
        """Check that every row can take `lengths[b]` more tokens (or `lengths` more, given one int) and return
        the key-slice length to attend over.

        Raises ContextOverflowError naming the overflow. Only reads the device when the host bound cannot rule an
        overflow out.
        """
        bound = self.host_bound + width
        if bound > self.max_len:
            needed = int((self.seen + lengths).max()) if self.batch_size else 0
            if needed > self.max_len:
                raise ContextOverflowError(
                    f"a row needs {needed} cache positions but the KV cache holds {self.max_len}",
                    hint="start a new conversation, drop old turns, or create a cache with a larger max_len",
                )
            bound = needed
        self.host_bound = bound
        return bound

    def append(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        query_pos: torch.Tensor,
        write: torch.Tensor,
        span: int,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store the entries of `layer` flagged in `write` (B', S) and return (keys, values, mask) to attend over.

        `k`, `v` are (B', S, H_kv, D) for tokens at absolute positions `query_pos` (B', S) of cache rows `rows`
        (all rows, in order, when None); flagged tokens are appended in order after the row's current entries.
        The mask (B', S, span) lets query s see its row's valid entries with position <= its own; a query that is
        not written (padding, unselected) sees everything so its discarded output stays finite.
        """
        lengths = self.lengths[layer] if rows is None else self.lengths[layer].index_select(0, rows)
        slots = lengths[:, None] + write.long().cumsum(1) - 1
        slots = torch.where(write, slots, self.max_len)
        row_ids = torch.arange(k.shape[0], device=k.device) if rows is None else rows
        row_ids = row_ids[:, None].expand_as(slots)
        self.keys[layer].index_put_((row_ids, slots), k.to(self.keys[layer].dtype))
        self.values[layer].index_put_((row_ids, slots), v.to(self.values[layer].dtype))
        self.positions[layer].index_put_((row_ids, slots), query_pos.to(torch.int32))
        lengths = lengths + write.sum(1)
        if rows is None:
            self.lengths[layer] = lengths
        else:
            self.lengths[layer].index_copy_(0, rows, lengths)
        return self.visible(layer, query_pos, write, span, rows)

    def visible(
        self, layer: int, query_pos: torch.Tensor, query: torch.Tensor, span: int, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys, values, mask) of `layer` for queries at absolute positions `query_pos` (B', S) of cache rows `rows`
        (all rows when None): the mask (B', S, span) lets query s see its row's live entries with position <= its
        own; a position that is not a real query (`query` False: padding, unselected) sees everything, so its
        discarded output stays finite."""
        if rows is None:
            lengths = self.lengths[layer]
            keys, values = self.keys[layer][:, :span], self.values[layer][:, :span]
            positions = self.positions[layer, :, :span]
        else:
            lengths = self.lengths[layer].index_select(0, rows)
            keys, values = self.keys[layer][rows, :span], self.values[layer][rows, :span]
            positions = self.positions[layer, rows, :span]
        slot_ids = torch.arange(span, device=query_pos.device)
        mask = (slot_ids[None, :] < lengths[:, None])[:, None, :] & (positions[:, None, :] <= query_pos[:, :, None])
        return keys, values, mask | ~query[:, :, None]

    # ------------------------------------------------------------------------------------------- row operations
    def select_rows(self, index: torch.Tensor) -> KVCache:
        """A new cache made of rows `index` (drop finished rows, or replicate one prefilled row to N samples)."""
        index = index.to(self.device)
        new = KVCache.__new__(KVCache)
        new.max_len = self.max_len
        new.batch_size = int(index.shape[0])
        new.keys = [k.index_select(0, index) for k in self.keys]
        new.values = [v.index_select(0, index) for v in self.values]
        new.positions = self.positions.index_select(1, index)
        new.lengths = self.lengths.index_select(1, index)
        new.seen = self.seen.index_select(0, index)
        new.prev_hidden = self.prev_hidden.index_select(1, index)
        new.host_bound = self.host_bound
        new.native_views = None
        return new

    def join(self, *others: KVCache) -> KVCache:
        """A new cache holding this cache's rows, then each of `others`' (rows admitted into a running batch), in
        one copy: every cache is first grown to the largest `max_len`, so entries keep their slots and the trash
        slot stays last."""
        caches = (self, *others)
        size = max(c.max_len for c in caches)
        for cache in caches:
            cache.grow(size)
        new = KVCache.__new__(KVCache)
        new.max_len = size
        new.batch_size = sum(c.batch_size for c in caches)
        new.keys = _joined_layers([c.keys for c in caches])
        new.values = _joined_layers([c.values for c in caches])
        new.positions = torch.cat([c.positions for c in caches], dim=1)
        new.lengths = torch.cat([c.lengths for c in caches], dim=1)
        new.seen = torch.cat([c.seen for c in caches])
        new.prev_hidden = torch.cat([c.prev_hidden for c in caches], dim=1)
        new.host_bound = max(c.host_bound for c in caches)
        new.native_views = None
        return new

    def row(self, index: int) -> KVCache:
        """Row `index` as a cache of one row whose tensors are views of this one's: what is written into it is
        written here. A prompt is prefilled into its own row this way, so its numbers never depend on the rows
        beside it (`engine.loop`)."""
        new = KVCache.__new__(KVCache)
        new.max_len = self.max_len
        new.batch_size = 1
        span = slice(index, index + 1)
        new.keys = [k[span] for k in self.keys]
        new.values = [v[span] for v in self.values]
        new.positions = self.positions[:, span]
        new.lengths = self.lengths[:, span]
        new.seen = self.seen[span]
        new.prev_hidden = self.prev_hidden[:, span]
        new.host_bound = self.host_bound
        new.native_views = None
        return new

    def mark(self) -> CacheMark:
        """Snapshot lengths, seen and router state (not the K/V storage: entries past a length are dead)."""
        return CacheMark(self.lengths.clone(), self.seen.clone(), self.prev_hidden.clone(), self.host_bound)

    def restore(self, mark: CacheMark) -> None:
        """Roll back to `mark`, which must come from this cache (same rows)."""
        if mark.seen.shape != self.seen.shape:
            raise ValueError(f"mark has {mark.seen.shape[0]} rows, cache has {self.batch_size}")
        self.lengths.copy_(mark.lengths)
        self.seen.copy_(mark.seen)
        self.prev_hidden.copy_(mark.prev_hidden)
        self.host_bound = mark.host_bound

    def grow(self, new_max_len: int) -> None:
        """Reallocate to hold `new_max_len` tokens per row, keeping every entry."""
        if new_max_len <= self.max_len:
            return
        old = self.max_len

        def bigger(t: torch.Tensor, axis: int) -> torch.Tensor:
            shape = list(t.shape)
            shape[axis] = new_max_len + 1
            out = t.new_zeros(shape)
            out.narrow(axis, 0, old).copy_(t.narrow(axis, 0, old))
            return out

        self.keys = [bigger(k, 1) for k in self.keys]
        self.values = [bigger(v, 1) for v in self.values]
        self.positions = bigger(self.positions, 2)
        self.max_len = new_max_len


def _joined_layers(parts: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Each layer's rows of every part, one after another, as views of one (L, B, ...) block, as `KVCache` makes
    its own: the native step reads every layer from one array, and layers made one tensor each would be stacked
    again (a second copy of the whole cache) at its first step."""
    first = parts[0][0]
    rows = sum(layers[0].shape[0] for layers in parts)
    block = torch.empty((len(parts[0]), rows, *first.shape[1:]), dtype=first.dtype, device=first.device)
    at = 0
    for layers in parts:
        count = layers[0].shape[0]
        for index, layer in enumerate(layers):
            block[index, at : at + count].copy_(layer)
        at += count
    return list(block.unbind(0))
