"""chatapp.engine: batched, streaming generation over the STT model.

`engine.py` tells the story (prefill, the decode loop, the single device→host copy per step); the helpers each do
one job: `sampling.py` (per-row settings and counter-based randomness), `detok.py` (UTF-8-safe text deltas),
`tools.py` (the calculator state machine), `programs.py` (TTFA programs), `constraints.py` (grammar masks),
`session.py` (multi-turn chat on one KV cache), `quick.py` (`chatapp generate "PROMPT"`). `events.py` is the
output contract the UI and CLI consume. Nothing is imported here, so `chatapp.engine.events` stays free of torch.
"""
