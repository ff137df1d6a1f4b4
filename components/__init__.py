"""Pulumi ComponentResources of the supernode stack (ARCHITECTURE.md §2)."""
