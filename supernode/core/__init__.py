"""The pure core: config schema and rules, catalog, capacity planner, Plan, output contract, errors.

Imports neither pulumi nor torch nor any other package of this project (an import-linter contract
in `.importlinter` enforces it), so the Pulumi program, the policy pack, the trainer image and the
CLI all build on it.
"""
