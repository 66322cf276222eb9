"""The driver side of a job: the ``Controller`` and the parts it owns (placement, the step loop per
mode, weights, checkpoints, step records, supervision), and the batch arithmetic (``batch``)."""
