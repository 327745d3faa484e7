"""mlaserve: an inference engine for the DeepSeek-V3 family (MLA + MoE)."""

from .llm import LLM
from .types import SamplingParams
from .version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]
