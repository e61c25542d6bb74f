"""The ``generic`` runtime family: any exported model, its first input from the device, its output as the command."""

from .plugin import GenericFamily

__all__ = ["GenericFamily"]
