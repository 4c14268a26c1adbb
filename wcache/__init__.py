"""wcache: fast, safe LLM engine restarts from a resident weight cache."""

__version__ = "0.1.0"
