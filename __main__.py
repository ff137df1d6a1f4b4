"""Entry point for the Pulumi CLI: the program is components/program.py (it runs on import), so the
installed package carries it too."""

import components.program  # noqa: F401
