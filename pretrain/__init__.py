"""lathe.pretrain: the training runtime every stage shares (`lathe.pretrain.runtime`:
launch, precision, FP8, optimizers, checkpoint/resume, logging, MFU, the run report) and,
as one user of it, pretraining (`train`, with its evaluation and bench); post-training
reuses the runtime (see docs/design.md)."""
