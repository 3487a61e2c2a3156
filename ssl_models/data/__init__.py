"""Data: loaders (datasets), batched on-device augmentations (augment), seeded partitioners (partition) and
the federated split of an experiment's data between clients and the server (splits)."""
