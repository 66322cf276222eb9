"""``rltpu plan``: candidates, cost model, hardware entries and micro-benchmarks, reports.
``planner.make_plan`` is the entry point."""
