"""Settings of the 'tpexample' backend: the ``policy.tpexample_cfg`` section (light: pydantic only)."""

from pydantic import BaseModel, ConfigDict, Field, PositiveInt


class TPExampleConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tensor_parallel_size: PositiveInt = Field(
        1, description="Ranks that split each linear layer of the decoder (tp); data parallelism is the rest."
    )
