"""lathe.data: sources, cleaning stages, dedup, BPE tokenizer training, token shards, and
task datasets for post-training (see DESIGN.md). May import `lathe.model` for configs only."""
