"""Training: corpus, tokenizer, target and drafter recipes."""
