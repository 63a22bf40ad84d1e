"""Qwen2-MoE: Qwen2's attention (q/k/v biases) with sparse MoE blocks that add a dense shared expert,
scaled per token by a sigmoid gate."""

from .moe import MoEAdapter


class Qwen2MoeAdapter(MoEAdapter):
    model_types = ("qwen2_moe",)

    def check_tp(self, config, tp: int) -> None:
        super().check_tp(config, tp)
        if config.shared_expert_intermediate_size % tp:
            raise ValueError(
                f"tp={tp} does not divide this qwen2_moe model's shared_expert_intermediate_size "
                f"{config.shared_expert_intermediate_size}: the shared expert is split over tp like a dense MLP"
            )
