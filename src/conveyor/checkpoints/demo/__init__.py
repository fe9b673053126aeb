"""The built-in demo model (random weights, real tokenizer) and the script that trains its tokenizer."""
