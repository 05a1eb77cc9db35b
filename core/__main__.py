"""`python -m lathe.core COMMAND ...` runs the `lathe` console script."""

import sys

from lathe.core.cli import main

sys.exit(main())
