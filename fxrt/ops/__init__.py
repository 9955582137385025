"""Op-level knowledge: schema binding and alias analysis (per node and per graph), user kernel
overrides (:mod:`.overrides`), fxrt's own CPU ops (:mod:`.own_ops`), Inductor's reinterpret op."""

from .aliasing import AliasSets, alias_sets, bind_schema_args, is_mutating, output_aliases

__all__ = ["AliasSets", "alias_sets", "bind_schema_args", "is_mutating", "output_aliases"]
