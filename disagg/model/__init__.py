"""Model: config, transformer, weight loader, tokenizer, embedded default model."""
