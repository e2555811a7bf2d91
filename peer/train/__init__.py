"""Training on one peer: model, tokenizer, data shard, inner loop (AdamW) and outer algorithms."""
