"""`accelerate launch ... -m lathe.pretrain --config ...` and `python -m lathe.pretrain`."""

import sys

from lathe.core.cli import run_command

if __name__ == "__main__":
    sys.exit(run_command("pretrain", sys.argv[1:]))
