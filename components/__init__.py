"""Pulumi ComponentResources of the supernode stack (docs/architecture.md §4); program.py wires them."""
