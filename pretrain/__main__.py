"""`accelerate launch ... -m lathe.pretrain --config ...` and `python -m lathe.pretrain`."""

import sys

from lathe.core.cli import exit_process, run_command

if __name__ == "__main__":
    exit_process(run_command("pretrain", sys.argv[1:]))
