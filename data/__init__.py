"""lathe.data: sources, cleaning stages, dedup, BPE tokenizer training, token shards, and
task datasets for post-training (see docs/design.md). Of lathe it imports only `lathe.core`."""
