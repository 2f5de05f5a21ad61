"""Whether this rlcore is one a plugin distribution accepts: its own ``Requires-Dist: rlcore...``.

"Needs a newer rlcore" is said where pip says it, in the distribution's
metadata, not in a plugin API version. A distribution installed next to an
rlcore it does not accept (``pip install --no-deps``, or a stale environment)
has its backends listed ``incompatible`` with this reason.
"""

from __future__ import annotations

from collections.abc import Iterable


def rlcore_requirement_problem(
    requires: Iterable[str] | None, distribution: str = "the plugin", installed: str | None = None
) -> str:
    """Why this rlcore does not satisfy the ``rlcore`` requirement among ``requires`` (the distribution's
    ``Requires-Dist`` lines); empty when it does, or when there is none."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    import rlcore

    installed = installed or rlcore.__version__
    for line in requires or ():
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if canonicalize_name(req.name) != "rlcore":
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # only for an extra of the plugin (e.g. its tests): not a requirement of the plugin
        if req.specifier and not req.specifier.contains(installed, prereleases=True):
            too_old = any(
                s.operator in (">", ">=", "~=", "==", "===")
                and Version(installed) < Version(s.version.removesuffix(".*"))
                for s in req.specifier
            )
            fix = "upgrade rlcore" if too_old else f"install a release of {distribution} made for rlcore {installed}"
            return f"requires rlcore{req.specifier}, this is {installed}: {fix}"
    return ""
