"""chatapp.models: the model registry (`tiny` shipped in the package), loading model directories, `load_engine`.

Building the shipped models is not here: the recipes live in `chatapp.recipes`.
"""

from chatapp.models.loader import LoadedModel, load_engine, load_model
from chatapp.models.registry import default_model_dir, resolve_model

__all__ = ["LoadedModel", "default_model_dir", "load_engine", "load_model", "resolve_model"]
