"""Support modules: checkpoint files, the tokenizer, command-line flags, GPU compile tables, the fast forms, the text
corpora and the processes of a multi-process fine-tune. The method is in the top-level files."""
