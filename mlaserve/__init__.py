"""mlaserve: an inference engine for the DeepSeek-V3 family (MLA + MoE)."""

from .llm import LLM
from .types import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
