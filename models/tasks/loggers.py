"""Loggers: one CSV metrics file per run folder, kept across resumes."""
from __future__ import annotations

import csv
import os

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


class _ContinuingWriter(ExperimentWriter):
    """Lightning's CSV writer, except that an existing ``metrics.csv`` is continued: its rows logged at steps
    before ``keep_before`` stay (all of them for ``keep_before=None``), the rest are dropped, new rows append."""

    def __init__(self, log_dir: str, keep_before: int | None):
        self._keep_before = keep_before
        super().__init__(log_dir=log_dir)

    def _check_log_dir_exists(self) -> None:  # Lightning's version deletes metrics.csv
        if not self._fs.isfile(self.metrics_file_path):
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as fh:
            reader = csv.DictReader(fh)
            header = list(reader.fieldnames or [])
            rows = [r for r in reader if self._kept(r.get("step"))]
        self.metrics_keys = header
        tmp = self.metrics_file_path + ".tmp"
        with self._fs.open(tmp, "w", newline="") as fh:  # written beside, then moved over: never half a file
            writer = csv.DictWriter(fh, fieldnames=header)
            writer.writeheader()
            writer.writerows(rows)
        self._fs.mv(tmp, self.metrics_file_path)

    def _kept(self, step: str | None) -> bool:
        if self._keep_before is None or step in (None, ""):
            return True
        return float(step) < self._keep_before


class RunCSVLogger(CSVLogger):
    """``CSVLogger`` with one ``metrics.csv`` per run folder (``<save_dir>/<name>/version_<version>``, version 0
    by default) that a resumed run continues instead of starting a ``version_<N+1>`` of its own.

    ``continue_from(step)`` (the training entry point calls it before fit, with the global step of the
    checkpoint it resumes) keeps the rows logged before that step and drops the later ones, which the
    interrupted run logged after its last checkpoint and the resumed run logs again. Lightning numbers a
    training row by the optimizer steps done before it (0 for the first), so a checkpoint taken after N steps
    holds exactly the rows with step < N. ``continue_from(None)`` keeps every row (a test-only run); a run
    that never calls it starts the file afresh, as ``CSVLogger`` does.
    """

    def __init__(self, save_dir: str | os.PathLike, name: str | None = "csv", version: int | str | None = 0,
                 prefix: str = "", flush_logs_every_n_steps: int = 100):
        super().__init__(save_dir=save_dir, name=name, version=version, prefix=prefix,
                         flush_logs_every_n_steps=flush_logs_every_n_steps)
        self._continue = False
        self._keep_before: int | None = None

    def continue_from(self, step: int | None) -> None:
        if self._experiment is not None:
            raise RuntimeError("RunCSVLogger.continue_from must be called before anything is logged")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"RunCSVLogger.continue_from: step must be an int >= 0 or None, got {step!r}")
        self._continue, self._keep_before = True, step

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is not None or not self._continue:
            return super().experiment
        from lightning.fabric.utilities.rank_zero import rank_zero_only

        if rank_zero_only.rank > 0:  # as CSVLogger: only rank 0 writes
            return super().experiment
        self._fs.makedirs(self.root_dir, exist_ok=True)
        self._experiment = _ContinuingWriter(self.log_dir, self._keep_before)
        return self._experiment
