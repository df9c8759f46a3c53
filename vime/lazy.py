"""Registries whose entries import their module only when used (optional dependencies stay optional)."""
import importlib


def lazy_constructor(module, name):
    """A callable that imports `module` on first call and calls its `name` with the arguments."""

    def make(*args, **kwargs):
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    return make
