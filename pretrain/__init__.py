"""lathe.pretrain: the training runtime (accelerate, precision, FP8, checkpoint/resume,
logging, MFU) and the pretraining loop; post-training reuses the runtime (see docs/design.md)."""
