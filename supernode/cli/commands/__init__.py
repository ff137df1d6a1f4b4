"""Subcommands of `supernode`; each module defines `register(subparsers)`."""
