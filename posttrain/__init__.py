"""lathe.posttrain: SFT, DPO, GRPO, distillation, LoRA and rewards, on the runtime in
`lathe.pretrain` (see docs/design.md). Nothing imports this package."""
