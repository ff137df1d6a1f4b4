"""The torch.distributed MoE trainer (torch + the supernode core only; never pulumi)."""
