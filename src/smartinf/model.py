"""``smartinf.model``, as before the sub-packages (``python -m smartinf.model``, ``import smartinf.model``):
an alias of ``smartinf.planning.model`` (its command line: ``smartinf.planning.model_cli``)."""
import sys

from smartinf.planning import model as _model

if __name__ == "__main__":  # the model's command line
    from smartinf.planning.model_cli import main
    sys.exit(main())
sys.modules[__name__] = _model
