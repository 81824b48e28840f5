"""``smartinf.plan``, as before the sub-packages (``python -m smartinf.plan``, ``import smartinf.plan``):
an alias of ``smartinf.planning.plan``."""
import sys

from smartinf.planning import plan as _plan

if __name__ == "__main__":
    sys.exit(_plan.main())
sys.modules[__name__] = _plan
