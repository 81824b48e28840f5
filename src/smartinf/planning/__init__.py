"""Planning: the performance model (``model.py``, its command line ``model_cli.py``),
``state_dtype="auto"`` (``plan.py``), the bytes a run will take checked first (``space.py``),
the probe's measured rates (``probe.py``, ``io_schedule.py``: which I/O schedule, and the
probe's records), the twins' policy (``twins.py``), the cores nearest a GPU
(``gpu_cores.py``) and the compute dtype (``compute_dtype.py``). Layer: beside the pipeline
API, which consults it; it opens no pipeline but the probe's."""
