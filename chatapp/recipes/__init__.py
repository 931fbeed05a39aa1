"""Recipes that build the shipped models: corpora, tokenizers, training runs, evaluation. Not needed to run the app.

`chats.py` holds what the recipes' generated chats share (calculator calls, letter-count answers, held-out splits);
each model's recipe is a subpackage: `tiny/` (the 3.35M model in `chatapp/models/tiny/`, rebuilt by
`python -m chatapp.recipes.tiny.build`) and `smollm2/` (the default SmolLM2-135M STT model). Corpus files of any
recipe or user are read by `chatapp.training.corpus`.
"""
