"""One optimizer step below the front-ends (``smartinf.optim``, ``smartinf.integrations``):
the session (``session.py``), its tail finished during the next forward (``tail.py``),
updates started during backward (``speculation.py``), each sub-group's gradient staged and
sent (``driver.py``, ``staging.py``), params edited between steps (``edits.py``) and rounding
as the devices round (``rounding.py``). Layer: above the pipeline API."""
