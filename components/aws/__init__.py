"""AWS resources: the network, the EKS cluster, the accelerator node groups, identity, storage, the
registry, monitoring and the stack's outputs."""
