"""Moved: the checkpoint-resume check is :mod:`rlcore.testing.conformance.resume_check`; this path re-exports it
for one release (rlcore 0.2)."""

from rlcore.testing.conformance.resume_check import (  # noqa: F401
    RECIPE,
    AdamRecipe,
    ResumeRun,
    ResumeTolerances,
    diagnose_update,
    resume_problems,
    resume_steps,
    run_resume,
    single_process_adam,
)
