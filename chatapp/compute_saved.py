"""What "compute saved" means, in one place: the share of all the model's block multiply-adds that STT routing did
not execute, net of what skipped tokens still compute. A block computation is one token through one decoder layer
(dense and STT layers alike), so the denominator is tokens x all decoder layers; a token an STT layer skips saves
that block less its `skip_cost`: nothing in "strict" mode, its K/V projection in "kv" mode (~6% of a block of the
default model), that and its predicted update in "predict" mode (~8%). Multiply-adds of the block's weights:
attention over the cache, which grows with the context, is left out of both sides.

Plain arithmetic, no torch: the reply fold (`chatapp.engine.reply`, read by the UI, the CLI and the batch records)
and held-out evaluation (`chatapp.training.evaluation`, read by `chatapp eval` and the recipes) both call it. The same
function over the STT layers only (`layers` = their count) gives the routed-layer share shown beside it.
"""

from __future__ import annotations

from typing import Any


def compute_saved(skipped_blocks: float, tokens: float, layers: int, skip_cost: float = 0.0) -> float:
    """`skipped_blocks`, each saving 1 - `skip_cost` of a block, over `tokens` x `layers` blocks (0 when none)."""
    total = tokens * layers
    return skipped_blocks * (1.0 - skip_cost) / total if total else 0.0


def skip_cost(config: Any) -> float:
    """The share of a block's weight multiply-adds that a token the block skips still computes, in the model's skip
    mode (`STTConfig.skip_mode`): 0 in "strict"; its K and V projections in "kv"; those and the rank-r predictor
    (2 r D + D) in "predict"."""
    mode = getattr(config, "skip_mode", "strict")
    if mode == "strict":
        return 0.0
    d, inter = config.hidden_size, config.intermediate_size
    head = config.head_dim or d // config.num_attention_heads
    query, kv = config.num_attention_heads * head, config.num_key_value_heads * head
    block = d * (query + 2 * kv) + query * d + 3 * d * inter
    kept = 2 * kv * d + ((2 * config.predictor_rank + 1) * d if mode == "predict" else 0)
    return kept / block
