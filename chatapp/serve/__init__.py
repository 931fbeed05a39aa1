"""`chatapp serve`: an OpenAI-compatible HTTP server over the engine, its requests batched together between decode
steps (`engine/continuous.py`). `command.py` starts it, `app.py` is the HTTP side, `scheduler.py` the one engine
loop, `requests.py` what a request may ask, `replies.py` what a reply looks like, `client.py` the light client the
CLI uses (`generate --server`). Nothing is imported here: the CLI imports the part it needs."""
