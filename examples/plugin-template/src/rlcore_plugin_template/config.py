"""Settings of the 'template' backend: the ``policy.template_cfg`` section of a config.

rlcore validates that section with this model when a config selects the
backend, so it is imported on the driver: keep it light (pydantic only).
"""

from pydantic import BaseModel, ConfigDict, Field


class TemplateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    grad_bucket_mb: float = Field(
        25.0, gt=0, description="Gradients are summed across ranks in flat buckets of about this many MiB."
    )
