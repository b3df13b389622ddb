"""What crosses a process boundary: torch-free and Ray-free (a test imports each module in a fresh
interpreter and checks), so the ingress, the router, the instance and the ranks share one set of types.

    request.py   ingress -> instance -> engine: ``GenerateRequest``; the context rule
    step.py      engine thread <-> ranks: ``StepPlan`` in a ``StepInput``, ``StepResult`` in a ``RankReply``
    stream.py    engine -> event loop -> ingress: ``StepOutput``, ``TokenDelta``
    cluster.py   instance <-> router <-> ingress: ``InstanceLoad``, ``LoadReport``, ``RouteDecision``
"""
