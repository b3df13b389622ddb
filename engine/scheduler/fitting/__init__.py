"""Fitting the latency estimator, torch-free: least-squares pieces (``fit.py``), the profiler's and the
served steps' samples and the whole-profile fit (``samples.py``, ``step_log.py``), and the online refit
that runs beside a serving instance (``online.py``)."""
