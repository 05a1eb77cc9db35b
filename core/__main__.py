"""`python -m lathe.core COMMAND ...` runs the `lathe` console script."""

from lathe.core.cli import exit_process, main

exit_process(main())
