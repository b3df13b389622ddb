"""``conflux profile``: the harness that drives the engine with hand-made step plans and times them
(``harness.py``), and where fitted profiles are found, checked and written (``store.py``)."""
