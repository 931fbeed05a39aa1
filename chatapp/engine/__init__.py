"""chatapp.engine: batched, streaming generation over the STT model.

`engine.py` is the request front (validation, `generate`, `generate_batch`, sessions); `loop.py` tells the decode
loop's story (prefill, one forward per step, the single device→host copy per step). The helpers each do one job:
`sampling.py` (per-row settings and counter-based randomness), `detok.py` (UTF-8-safe text deltas), `tools.py`
(the calculator state machine), `programs.py` (TTFA programs), `constraints.py` (grammar masks), `session.py`
(multi-turn chat on one KV cache), `protocols.py` (what the engine needs from the model, cache and chat format).
Console rendering of a reply (`chatapp generate "PROMPT"`) is the CLI's: `chatapp/cli/render.py`. `events.py` is the output contract the UI and CLI consume and `reply.py`
the one fold of those events into a reply and its statistics; both are free of torch, and nothing is imported
here so they stay that way.
"""
