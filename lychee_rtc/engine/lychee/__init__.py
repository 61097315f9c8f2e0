"""The ``lychee`` engine backend: Lychee-FD in PyTorch (model, loader, runner, StepBackend)."""
