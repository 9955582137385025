"""Facts over the IR that the passes, the lifetime planner and the executors share.

:mod:`~fxrt.analysis.values`: which ops are pure or have side effects, which values a node
writes, which alias sets are written or returned. :mod:`~fxrt.analysis.streams`: which stream
each node runs on and the vector clocks of an ordered multi-stream graph. The modules here read
the IR and the op tables (:mod:`fxrt.ir`, :mod:`fxrt.ops`) and import nothing from
:mod:`fxrt.passes` or :mod:`fxrt.exec`, so both may import them.
"""
