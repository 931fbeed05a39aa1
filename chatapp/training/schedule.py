"""The learning-rate schedule every trainer here uses: linear warm-up, then cosine decay to a floor.

One function so the generic STT loop (`training.loop`), the default model's recipe (`recipes.smollm2.train`) and the
routing fine-tune (`training.tune`) cannot drift apart: they returned bit-identical factors before they shared it.
"""

from __future__ import annotations

import math


def warmup_cosine(step: int, total: int, warmup: int, floor: float = 0.1) -> float:
    """The factor on the peak learning rate at `step` (0-based) of `total` steps.

    Warm-up: (step + 1) / warmup for the first `warmup` steps, so step 0 already trains (a zero first step would
    waste a batch) and step warmup - 1 reaches the peak. Then a half cosine from 1 at step `warmup` to `floor` at
    step `total`, held at `floor` past it (a resumed run asked for more steps than planned keeps a sane rate).
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
