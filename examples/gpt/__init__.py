"""End-to-end demo: a compact GPT trained on generated text, to compare optimizers."""
