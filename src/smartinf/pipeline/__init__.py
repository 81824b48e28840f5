"""The pipeline API (``smartinf.Pipeline``) and what it is opened with: the per-sub-group
pipeline over the native core (``pipeline.py``, its step protocol ``steps.py`` and its states
between steps ``states.py``), its settings, the device specs, host buffers, SmartComp, and
the device directories' checkpoints. Layer: above the binding, below the step
(``smartinf.step``) and the front-ends."""
