"""chatapp.models: the embedded default model, its corpus and tokenizer, and loading model directories."""

from chatapp.models.loader import LoadedModel, load_model

__all__ = ["LoadedModel", "load_model"]
