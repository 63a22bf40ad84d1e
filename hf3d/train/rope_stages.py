"""Long-context stages: the model's RoPE settings follow `data.stages` during `hf3d train`.

A stage may give rope_theta, rope_scaling and max_position_embeddings (and its own seq_len, which the
data pipeline reads). The settings of a step are model.* overridden by those of every stage up to the
step's, always applied to the config the run started from (not to the previous stage's), so a run
resumed in the middle of a stage builds exactly the model of the run that went through.
"""

from __future__ import annotations

from collections.abc import Callable

from .checks import stage_model_overrides
from .config import TrainConfig


class StageRoPE:
    """The model's RoPE settings follow the data stages: at a stage whose settings (rope_theta,
    rope_scaling, max_position_embeddings; model.* overridden by the stages so far) differ from the
    model's, the config and every stage's rotary buffers are rebuilt in place (parallelize.set_rope)
    from the base config, so a resumed run gets the same model as one that ran through."""

    def __init__(self, cfg: TrainConfig, pmodel, pipe, base_config, say: Callable[[str], None] | None):
        self.cfg, self.pmodel, self.pipe, self.base_config, self.say = cfg, pmodel, pipe, base_config, say
        self.applied = cfg.model.overrides()  # what parallelize built the model with

    def enter(self, step: int) -> None:
        """Give the model the settings of `step`'s stage (nothing when it has them)."""
        from ..parallelize import set_rope  # transformers: loaded once the run is under way

        stage = self.pipe.stages[self.pipe.stage_index(step)]
        wanted = stage_model_overrides(self.cfg, stage)
        if wanted == self.applied:
            return
        set_rope(self.pmodel, wanted, base_config=self.base_config)
        self.applied = wanted
        if self.say:
            rope = self.pmodel.config.rope_parameters
            self.say(
                f"hf3d: step {step + 1}: data stage {stage.name!r}, seq_len {stage.seq_len}; the model's RoPE is now "
                f"{rope}, max_position_embeddings {self.pmodel.config.max_position_embeddings}"
            )
