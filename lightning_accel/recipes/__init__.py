"""Training recipes: plain-torch functional cores and, in ``callbacks.py``, the Lightning callbacks that adapt them.

- :mod:`~lightning_accel.recipes.lr`: linear LR scaling and the :class:`WarmupCosineLR` schedule.
- :mod:`~lightning_accel.recipes.distill`: knowledge-distillation loss and teacher handling.
- :mod:`~lightning_accel.recipes.channel_groups`: which channels can be removed together (a ``torch.fx`` trace).
- :mod:`~lightning_accel.recipes.prune`: structured pruning that physically removes those channels.
"""

from lightning_accel.recipes.callbacks import KnowledgeDistillation, LinearScalingLR, PerStepLR, StructuredPruning
from lightning_accel.recipes.channel_groups import ChannelGroup, find_channel_groups
from lightning_accel.recipes.distill import (
    check_distillation_args,
    check_logits_match,
    combine_losses,
    distillation_loss,
    freeze_teacher,
    load_teacher,
)
from lightning_accel.recipes.lr import (
    APPLIED_KEY,
    WarmupCosineLR,
    apply_lr_scale,
    linear_scaling_factor,
    warmup_cosine_value,
)
from lightning_accel.recipes.prune import (
    PruneResult,
    apply_structured_pruning,
    batch_norms,
    channel_importance,
    check_amount,
    count_parameters,
    recalibrate_batchnorm,
    resize_to_state_dict,
    schedule_amounts,
)

__all__ = [
    "APPLIED_KEY",
    "ChannelGroup",
    "KnowledgeDistillation",
    "LinearScalingLR",
    "PerStepLR",
    "PruneResult",
    "StructuredPruning",
    "WarmupCosineLR",
    "apply_lr_scale",
    "apply_structured_pruning",
    "batch_norms",
    "channel_importance",
    "check_amount",
    "check_distillation_args",
    "check_logits_match",
    "combine_losses",
    "count_parameters",
    "distillation_loss",
    "find_channel_groups",
    "freeze_teacher",
    "linear_scaling_factor",
    "load_teacher",
    "recalibrate_batchnorm",
    "resize_to_state_dict",
    "schedule_amounts",
    "warmup_cosine_value",
]
