"""``smartinf.probe``, as before the sub-packages (``python -m smartinf.probe``, ``import smartinf.probe``):
an alias of ``smartinf.planning.probe`` (its command line: ``smartinf.planning.probe_cli``)."""
import sys

from smartinf.planning import probe as _probe

if __name__ == "__main__":  # the probe's command line
    from smartinf.planning.probe_cli import main
    sys.exit(main())
sys.modules[__name__] = _probe
