"""Op-level knowledge: schema binding and alias analysis."""

from .aliasing import bind_schema_args, is_mutating, output_aliases

__all__ = ["bind_schema_args", "is_mutating", "output_aliases"]
