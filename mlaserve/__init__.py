"""mlaserve: an inference engine for the DeepSeek-V3 family (MLA + MoE)."""

from .llm import LLM
from .types import SamplingParams, StructuredOutput
from .version import __version__

__all__ = ["LLM", "SamplingParams", "StructuredOutput", "__version__"]
