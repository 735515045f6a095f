"""Data out: the output folder (JSONL stream, Parquet, summary numbers, files written whole), plots, progress.

Modules: `writer.py` (the trajectory stream and the folder's names), `parquet.py`, `summary.py`
(summary.json's numbers), `engine_use.py` (how busy a step kept the engines), `atomic_file.py` (files
written whole), `timeline.py` (the timeline plot), `training_plot.py` (training.png: the training signal
per step, also from a trainer's StepResults), `progress.py` (the progress line of `agentloop rollout`).
"""

from .atomic_file import atomic_write
from .parquet import MESSAGE_FIELDS, message_from_parquet, write_parquet
from .summary import summarize_run, summarize_step, write_summary
from .writer import JSONL_NAME, OUTPUT_NAMES, TrajectoryStream, clear_outputs, trajectory_record

__all__ = ["JSONL_NAME", "MESSAGE_FIELDS", "OUTPUT_NAMES", "TrajectoryStream", "atomic_write", "clear_outputs",
           "message_from_parquet", "summarize_run", "summarize_step", "trajectory_record", "write_parquet",
           "write_summary"]
