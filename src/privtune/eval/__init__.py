"""Evaluation of trained models beyond classification accuracy (generation: decoding, BLEU, chrF, ROUGE-L,
perplexity).  Optional dependencies are imported when a function needs them."""
