"""attnzoo: native LLMs over one shared paged attention layer, with a per-GPU backend policy."""
from attnzoo.engine.compat import CompletionOutput, RequestOutput, SamplingParams
from attnzoo.engine.engine import Completion
from attnzoo.engine.llm import LLM, load_model
from attnzoo.engine.load_config import LoadConfig
from attnzoo.errors import AttnzooError

__all__ = ["LLM", "Completion", "CompletionOutput", "RequestOutput", "SamplingParams", "load_model", "LoadConfig", "AttnzooError"]
__version__ = "0.1.0"
