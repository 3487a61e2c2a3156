"""Federated math over models and representations, free of Flower: merging client and global weights
(model_merge), similarity matrices and their transport (similarity), ensemble similarity distillation
(distillation)."""
