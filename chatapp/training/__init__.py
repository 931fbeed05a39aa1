"""Build-time code: fitting a model's parts (`route`: STT routing with the backbone frozen).

Nothing in the runtime (engine, models, stt, ui, cli's generation commands) imports this package; only the
commands that build something (`chatapp route`) load it, lazily.
"""
