"""The training runtime every lathe training stage runs on — pretraining and each
post-training stage alike: the launch and its check (`launch`), the precision policy
(`precision`), model converters such as FP8 (`converters`), optimizers and schedules,
resumable state (`state`), metrics and MFU (`monitor`), the step loop and export
(`trainer`), its config (`config`), and the report card of a whole run (`report`).

It lives under `lathe.pretrain` because lathe's top-level packages are fixed; pretraining
(`lathe.pretrain.train`) is one of its users, beside `lathe.posttrain`'s stages.
"""
