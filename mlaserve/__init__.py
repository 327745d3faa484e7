"""mlaserve: an inference engine for the DeepSeek-V3 family (MLA + MoE)."""

from .llm import LLM, default_draft_path, default_model_path
from .types import SamplingParams, StructuredOutput
from .version import __version__

__all__ = ["LLM", "SamplingParams", "StructuredOutput", "__version__", "default_draft_path", "default_model_path"]
