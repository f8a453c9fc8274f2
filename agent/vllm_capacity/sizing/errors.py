"""What the planner raises when it cannot give a figure: each message says why, with the numbers."""

from __future__ import annotations


class NotModelled(ValueError):
    """vLLM sizes this model with rules the planner does not implement (yet); the message says which."""


class ImpossiblePlan(ValueError):
    """The plan cannot run: the message gives the numbers."""
