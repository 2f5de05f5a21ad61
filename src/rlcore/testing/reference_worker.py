"""Moved: the reference backend is production code, :mod:`rlcore.backends.reference.worker`.

This path re-exports it for one release (rlcore 0.2) and warns; import
``rlcore.backends.reference.worker`` instead.
"""

import warnings

from rlcore.backends.reference.worker import ReferenceWorker

warnings.warn(
    "rlcore.testing.reference_worker moved to rlcore.backends.reference.worker; this alias goes in rlcore 0.3",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["ReferenceWorker"]
