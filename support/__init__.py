"""What the core stands on, importing nothing of it: checkpoint files, the tokenizer, command-line flags, the GPU
kernels and their compile tables, several processes, the text corpora."""
