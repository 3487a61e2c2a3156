"""Federated math over models and representations, free of Flower: merging client and global weights
(model_merge), similarity matrices and their transport (similarity), ensemble similarity distillation
(distillation), centered kernel alignment (cka) and Hetero-SSFL's RAD kernels and alignment term
(kernel_alignment)."""
