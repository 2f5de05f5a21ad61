"""Backend-independent training utilities: optimizer/scheduler building, gradient clipping, checkpoints."""
