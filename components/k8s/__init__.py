"""Kubernetes objects on the cluster: add-ons, Kueue queues, the training namespace, the interconnect
gate, the trainer job, serving and day-2 operations."""
