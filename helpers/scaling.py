"""Placeholder: filled in by its topic (see CONTRIBUTING.md)."""

__all__: list[str] = []
