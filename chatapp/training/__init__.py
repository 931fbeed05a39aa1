"""Build-time code: training and fitting models, apart from the runtime that serves them.

- `loop`: the generic STT training loop (`chatapp train`, the tiny recipe);
- `schedule`: the one learning-rate schedule; `checkpoint`: the one checkpoint writer (through `chatapp.store`);
- `calibrate`: the student router's decision threshold (both recipes);
- `route` / `tune`: `chatapp route`'s routing fit with the backbone frozen, and its LoRA fine-tune.

Nothing in the runtime (engine, models, stt, ui, cli's generation commands) imports this package; only the
commands that build something (`chatapp train`, `route`, `eval`) and the recipes load it, lazily.
"""
