"""runlog/: the one owner of everything a run writes in its workdir. RunLog (log.py) writes it; its
records and tables (records.py), TensorBoard events (events.py), the workdir's identity and lock
(workdir.py), the background checkpoint writer (saver.py) and storage failures (storage.py) are its
parts. The names below are the package's face."""

from ripples_jax.errors import ResumeRefused, StorageError
from ripples_jax.runlog.events import hparams, tb_tag
from ripples_jax.runlog.log import RunLog
from ripples_jax.runlog.records import (
  SUMMARY_KEYS,
  archive,
  check_finite,
  count_lines,
  cut_records,
  event_files,
  last_step,
  numbered,
  pipeline_table,
  summary_table,
  to_python,
  whole_records,
  write_json,
)
from ripples_jax.runlog.storage import tensorstore_os_error
from ripples_jax.runlog.workdir import (
  IDENTITY_FREE,
  differences,
  flat_config,
  identity,
  make_workdir,
  newest_meta,
)

__all__ = [
  "RunLog",
  "ResumeRefused",
  "StorageError",
  "SUMMARY_KEYS",
  "IDENTITY_FREE",
  "archive",
  "check_finite",
  "count_lines",
  "cut_records",
  "differences",
  "event_files",
  "flat_config",
  "hparams",
  "identity",
  "last_step",
  "make_workdir",
  "newest_meta",
  "numbered",
  "pipeline_table",
  "summary_table",
  "tb_tag",
  "tensorstore_os_error",
  "to_python",
  "whole_records",
  "write_json",
]
