"""Hub model names that are neither local nor cached: does the hub have them, and can it be reached?

:func:`rlcore.preflight.models.check_model_sources` never touches the network: online, it leaves a hub name to the
workers' download. A name with no network behind it then costs 2 × 5 retries and a 100-line traceback after
50 s, and a misspelt one fails the same way. Here each such name is asked of the hub once, with a short
timeout, before anything starts; a hub that cannot be reached is asked only once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

#: Seconds one question to the hub may take (connecting included).
HUB_TIMEOUT_S = 1.5


def hub_problems(named: Iterable[tuple[str, str]]) -> list[str]:
    """One line per ``(config key, model name)`` that is a hub name, not a local directory nor cached, which
    the hub does not have or cannot be asked about. Offline (``HF_HUB_OFFLINE``) names are left to
    :func:`rlcore.preflight.models.check_model_sources`; a name seen under an earlier key is not asked again."""
    from rlcore.preflight.models import hub_offline

    if hub_offline():
        return []
    problems: list[str] = []
    seen: set[str] = set()
    unreachable: str | None = None
    for key, name in named:
        if name in seen or not _is_hub_name(name) or _cached(name):
            continue
        seen.add(name)
        if unreachable is None:
            problem, unreachable = _ask_hub(name)
        else:
            problem = None
        if unreachable is not None:
            problem = _unreachable_line(name, key, unreachable)
        if problem:
            problems.append(f"{key}: {problem}")
    return problems


def _is_hub_name(name: str) -> bool:
    from rlcore.preflight.models import builtin_near_miss, is_hub_id

    return is_hub_id(name) and not os.path.exists(name) and builtin_near_miss(name) is None


def _cached(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    from rlcore.preflight.models import HUB_CACHE_FILES

    return any(isinstance(try_to_load_from_cache(name, filename), str) for filename in HUB_CACHE_FILES)


def _ask_hub(name: str) -> tuple[str | None, str | None]:
    """(the problem with ``name`` on the hub, or None; why the hub cannot be reached, or None)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    endpoint = _endpoint()
    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        return (
            f"{name} is gated on the Hugging Face hub: accept its terms at {endpoint}/{name} and log in "
            "(hf auth login), or set it to a local model directory",
            None,
        )
    except RepositoryNotFoundError:
        return (
            f"{name} is not a local directory, and the Hugging Face hub ({endpoint}) has no model of that name; "
            "check the name (log in with hf auth login if it is private), or set it to a local model directory",
            None,
        )
    except HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status is not None and status < 500:
            return None, None  # the hub answered: let the download say what it says
        return None, _why(exc)
    except Exception as exc:  # noqa: BLE001 - no network, DNS, a timeout, a proxy: the hub cannot be reached
        return None, _why(exc)
    return None, None


def _why(exc: BaseException) -> str:
    """An error in a few words: its type and the first line of its message."""
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {text[:160]}" if text else type(exc).__name__


def _unreachable_line(name: str, key: str, why: str) -> str:
    from huggingface_hub import constants

    return (
        f"{name} is not a local directory and not in the Hugging Face cache ({constants.HF_HUB_CACHE}), and the "
        f"hub ({_endpoint()}) cannot be reached ({why}): download it where there is network (hf download "
        f"{name}) or set {key} to a local model directory"
    )


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


__all__ = ["HUB_TIMEOUT_S", "hub_problems"]
