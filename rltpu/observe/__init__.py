"""What a run shows while it runs and after: actor health (``health``), the prompt ledger
(``ledger``), per-step metrics and their loggers (``metrics``, ``loggers``), the dashboard."""
