"""supernode core: stack configuration, accelerator catalog, parallel plan and capacity planner.

The config / catalog / capacity / plan modules import neither pulumi nor torch, so the trainer
image and the policy pack can both use them.
"""

__version__ = "0.1.0"
