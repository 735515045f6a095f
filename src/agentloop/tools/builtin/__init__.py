"""Built-in tools: `calculator` (safe arithmetic with `ast`) and `python` (sandboxed subprocess)."""

from .calculator import CalculatorTool, evaluate
from .python import PythonTool

__all__ = ["CalculatorTool", "PythonTool", "evaluate"]
