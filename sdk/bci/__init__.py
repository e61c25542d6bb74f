"""iBCI handwriting decoder family."""
