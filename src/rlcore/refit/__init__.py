"""Weight refit: moving training weights into a generation engine (design.md §2.7)."""

from rlcore.refit.buckets import RefitError, RefitMetadata, check_metadata, metadata_of, plan_buckets
from rlcore.refit.export import DEFAULT_BUCKET_BYTES, RefitExportMixin
from rlcore.refit.synchronizer import WeightSynchronizer

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "RefitError",
    "RefitExportMixin",
    "RefitMetadata",
    "WeightSynchronizer",
    "check_metadata",
    "metadata_of",
    "plan_buckets",
]
