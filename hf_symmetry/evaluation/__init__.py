from ..text import read_text, tokenize_text
from .perplexity import PerplexityResult, perplexity

__all__ = ["PerplexityResult", "perplexity", "read_text", "tokenize_text"]
