"""Measuring models and folders: loading and comparing (:mod:`.compare`), the one perplexity definition
(:mod:`.perplexity`), the verification of every conversion (:mod:`.verification`), lm-eval runs
(:mod:`.bridge`), real weight quantizers (:mod:`.weight_quant`, :mod:`.ggml_quants`) and plots.

Import from the modules themselves: this package re-exports nothing, so ``hf_symmetry.evaluation.perplexity``
is the module (the text helpers are :mod:`hf_symmetry.text`'s)."""
