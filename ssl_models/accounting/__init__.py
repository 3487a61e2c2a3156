"""Resource accounting in pure PyTorch (docs/methods/lwfedssl.md, Resource accounting): FLOPs of one training step and analytic memory.

- ``flops``: ``torch.utils.flop_counter.FlopCounterMode`` (2 FLOPs per multiply-add, the backward that actually
  runs, so frozen layers show up) around one complete training step or one forward;
- ``memory``: parameters + gradients + optimiser state + saved activations (measured with
  ``torch.autograd.graph.saved_tensors_hooks``, deduplicated by storage), and the process's RSS high-water mark.

Nothing here imports Flower; the Flower side multiplies per-step figures by steps per round and adds bytes sent.
"""

from ssl_models.accounting.flops import (
    backbone_training_flops,
    forward_flops,
    function_training_flops,
    training_step_flops,
)
from ssl_models.accounting.memory import (
    analytic_training_memory,
    optimizer_state_factor,
    process_peak_rss_bytes,
    reset_peak_rss,
    saved_activation_bytes,
)

__all__ = [
    "analytic_training_memory",
    "backbone_training_flops",
    "forward_flops",
    "function_training_flops",
    "optimizer_state_factor",
    "process_peak_rss_bytes",
    "reset_peak_rss",
    "saved_activation_bytes",
    "training_step_flops",
]
