"""chatapp.stt: the Subjective Timescale Transformer (Qwen2-compatible), its sparse KV cache and its training."""

from chatapp.stt.cache import CacheMark, KVCache
from chatapp.stt.config import STTConfig
from chatapp.stt.model import ExtendOutput, STTForCausalLM

__all__ = ["CacheMark", "ExtendOutput", "KVCache", "STTConfig", "STTForCausalLM"]
