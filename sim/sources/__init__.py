"""Neural sources for the headstage emulator, registered by name (``sim://headstage?source=NAME``)."""

from .base import NEURAL_SOURCES, NeuralSource, UnknownSourceError, make_source, register_source, source_class
from .handwriting import HandwritingSource  # noqa: F401 - registers source=handwriting
from .poisson import PoissonSource

__all__ = ["NEURAL_SOURCES", "NeuralSource", "UnknownSourceError", "make_source", "register_source",
           "source_class", "PoissonSource"]
