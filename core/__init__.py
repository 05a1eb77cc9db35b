"""lathe.core: what every lathe package shares and nothing else — typed configs loaded
from YAML recipes with dotted command-line overrides, the user-facing error types, atomic
file writes, the `lathe` command (each package registers its own subcommands), and the
progress/W&B helpers long jobs use. It imports no other lathe package (see docs/design.md)."""

from lathe.core.config import load_config
from lathe.core.errors import ConfigError, LatheError

__all__ = ["ConfigError", "LatheError", "load_config"]
