"""Chips and the processes that own them: the chip table and roles (``topology``), Ray with real or
emulated TPU nodes (``cluster``), the per-process device/backend decision (``backend``) and what a
chip-owning process does before its engine exists (``runtime``)."""
