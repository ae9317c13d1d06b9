from .perplexity import PerplexityResult, perplexity, read_text, tokenize_text

__all__ = ["PerplexityResult", "perplexity", "read_text", "tokenize_text"]
