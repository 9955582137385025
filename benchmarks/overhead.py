"""Host-overhead benchmark W1-W3: the same as ``python -m fxrt bench`` (see fxrt/bench.py)."""

import sys

from fxrt.bench import main

if __name__ == "__main__":
    sys.exit(main())
