"""Thin Ray actor classes: each owns its chips and forwards to an engine tested without Ray.

They carry no ``@ray.remote``; the controller wraps them with ``ray.remote(...).options(...)``.
"""
