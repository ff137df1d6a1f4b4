"""Entry point for the Pulumi CLI: the program is a function in the package (components/program.py), so
the installed package carries it too."""

from supernode.components.program import main

main()
