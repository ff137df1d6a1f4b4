"""Programs that check a GPU node rather than train: the interconnect check (fabric) and the node
inventory (inventory)."""
