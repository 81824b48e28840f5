"""``smartinf.compress`` (``smartinf.compress.TopK``), as before the sub-packages: an alias
of ``smartinf.pipeline.compress``."""
import sys

from smartinf.pipeline import compress as _compress

sys.modules[__name__] = _compress
