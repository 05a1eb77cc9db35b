"""`python -m lathe.model COMMAND ...` runs the `lathe` console script."""

import sys

from lathe.model.cli import main

sys.exit(main())
