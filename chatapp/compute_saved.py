"""What "compute saved" means, in one place: the share of all the model's block computations that STT routing
skipped. A block computation is one token through one decoder layer (dense and STT layers alike), so the
denominator is tokens x all decoder layers. A token an STT layer skips counts as skipped in either skip mode: in
"kv" mode it still projects its K/V (about 6% of a block), which this share leaves out.

Plain arithmetic, no torch: the reply fold (`chatapp.engine.reply`, read by the UI, the CLI and the batch records)
and held-out evaluation (`chatapp.training.evaluation`, read by `chatapp eval` and the recipes) both call it. The same
function over the STT layers only (`layers` = their count) gives the routed-layer share shown beside it.
"""

from __future__ import annotations


def compute_saved(skipped_blocks: float, tokens: float, layers: int) -> float:
    """`skipped_blocks` over `tokens` x `layers` block computations (0 when there are none)."""
    total = tokens * layers
    return skipped_blocks / total if total else 0.0
