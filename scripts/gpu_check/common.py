"""What every step of ``make gpu-check`` shares: where the checkout is, what rlcore needs, the log line."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "runs" / "gpu-check"
#: What rlcore needs to import at all, with the wheel(s) that provide it.
REQUIRED = {
    "torch": "the machine's CUDA torch (never installed here)",
    "transformers": "transformers",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "numpy": "numpy",
    "pydantic": "pydantic + pydantic-core, annotated-types, typing-inspection, typing-extensions",
    "pluggy": "pluggy",
    "typer": "typer",
    "yaml": "pyyaml",
    "pytest": "pytest",
}
#: What some checks need; without it they are skipped, and the run is reported incomplete.
OPTIONAL = {
    "ray": "ray + jsonschema, jsonschema-specifications, referencing, rpds-py: every Policy test and the benchmark",
    "megatron.core": "megatron-core: the megatron tests and benchmark rows",
    "pytest_timeout": "pytest-timeout: a hung test fails alone instead of stopping the run at the budget",
}


def log(message: str) -> None:
    print(f"gpu-check: {message}", flush=True)
