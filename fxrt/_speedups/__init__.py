"""fxrt's compiled loop: a Cython extension in C++ mode (``_loop``), built by setup.py.

Import it through :mod:`fxrt.exec.native`, which checks that it was built against the running
torch and falls back to the Python loop otherwise.
"""
