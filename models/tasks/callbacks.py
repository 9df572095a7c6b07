"""Callbacks: training throughput (samples/s, tokens/s) and peak memory."""
from __future__ import annotations

import math
import os
import resource
import signal
import sys
import threading
import time

import lightning as L
import torch


def _batch_counts(batch: dict) -> tuple[int, int]:
    """(samples, real tokens): residues of the query for MSA batches, non-pad tokens for LM batches."""
    if "seq_mask" in batch:
        return batch["seq_mask"].shape[0], int(batch["seq_mask"].sum())
    if "pad_mask" in batch:
        return batch["pad_mask"].shape[0], int(batch["pad_mask"].sum())
    first = next(v for v in batch.values() if torch.is_tensor(v))
    return first.shape[0], first[0].numel() * first.shape[0]


def peak_memory_mib(device: torch.device) -> tuple[float, str]:
    """Peak memory in MiB: CUDA ``max_memory_allocated`` on a GPU, else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda max_memory_allocated"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**20 if sys.platform == "darwin" else 2**10), "host peak RSS"


class ThroughputMonitor(L.Callback):
    """Times training steps (after ``warmup_steps``), logs ``perf/samples_per_s``, ``perf/tokens_per_s``
    and ``perf/peak_mem_mib``, and prints a summary when training ends (``self.summary``)."""

    def __init__(self, warmup_steps: int = 3, log_every_n_steps: int = 10):
        super().__init__()
        self.warmup_steps, self.log_every_n_steps = warmup_steps, log_every_n_steps
        self.summary: dict = {}
        self._reset()

    def _reset(self):
        self._t0 = None
        self._steps = self._samples = self._tokens = 0
        self._time = 0.0
        self._warm = (0, 0, 0.0)

    def _sync(self, pl_module):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_start(self, trainer, pl_module):
        self._reset()
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._sync(pl_module)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._sync(pl_module)
        dt = time.perf_counter() - self._t0
        self._steps += 1
        samples, tokens = _batch_counts(batch)
        if self._steps <= self.warmup_steps:  # kept apart: used only if training stops within warm-up
            self._warm = (self._warm[0] + samples, self._warm[1] + tokens, self._warm[2] + dt)
            return
        self._samples += samples
        self._tokens += tokens
        self._time += dt
        if self._steps % self.log_every_n_steps == 0:
            pl_module.log_dict(self._rates(pl_module), on_step=True, on_epoch=False)

    def _rates(self, pl_module) -> dict:
        mem, _ = peak_memory_mib(pl_module.device)
        t = max(self._time, 1e-9)
        return {"perf/samples_per_s": self._samples / t, "perf/tokens_per_s": self._tokens / t, "perf/peak_mem_mib": mem}

    def on_train_end(self, trainer, pl_module):
        mem, kind = peak_memory_mib(pl_module.device)
        timed = max(0, self._steps - self.warmup_steps)
        if timed == 0:  # too short to skip the warm-up: report the warm-up steps
            self._samples, self._tokens, self._time = self._warm
            timed = self._steps
        self.summary = {
            "timed_steps": timed,
            "samples_per_s": self._samples / self._time if self._time else float("nan"),
            "tokens_per_s": self._tokens / self._time if self._time else float("nan"),
            "step_ms": 1000 * self._time / timed if timed else float("nan"),
            "peak_mem_mib": mem,
            "peak_mem_kind": kind,
            "device": str(pl_module.device),
        }
        if trainer.is_global_zero:
            s = self.summary
            print(
                f"[throughput] {s['samples_per_s']:.2f} samples/s, {s['tokens_per_s']:.0f} tokens/s, "
                f"{s['step_ms']:.1f} ms/step over {timed} steps; peak memory {mem:.0f} MiB ({kind}) on {s['device']}",
                flush=True,
            )


# ---------------------------------------------------------------------------------------------------
# checkpoints and run records

from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint  # noqa: E402

RUN_STATE_KEY = "attn_zoo_run"


class LastCheckpoint(ModelCheckpoint):
    """``last.ckpt`` every ``every_n_train_steps``, on an exception, and always at the end of training,
    so it holds the final step. The end-of-fit save records ``checkpoint["attn_zoo_run"] =
    {"finished": True, "max_steps", "max_epochs"}``, which lets a resume of a finished run do nothing.
    The version counter is off: there is one ``last.ckpt`` per run folder, never ``last-v1.ckpt``.

    Beside it, each save also writes a ``filename`` checkpoint (``step<N>.ckpt``). ``keep_last``: how many of
    those stay in ``dirpath`` (the newest by step; None keeps all); the older ones are deleted only after a
    new one has been written, so the newest ``keep_last`` survive a save cut short and ``resume=true`` has one
    to fall back on. Only files of this callback's name pattern are touched, never ``last.ckpt`` or ``best-*``.
    """

    def __init__(self, keep_last: int | None = 2, **kwargs):
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"LastCheckpoint: keep_last must be an int >= 1 or null (keep all), got {keep_last!r}")
        kwargs.setdefault("save_last", True)
        kwargs.setdefault("enable_version_counter", False)
        kwargs.setdefault("save_top_k", -1)  # Lightning keeps every step file; keep_last prunes them
        super().__init__(**kwargs)
        self.keep_last = keep_last
        self._finishing = False

    def _step_files(self) -> list[tuple[int, str]]:
        """(step, path) of every file in ``dirpath`` named by this callback's ``filename`` pattern, newest first."""
        import re

        if not self.dirpath or not self._fs.isdir(self.dirpath):
            return []
        pattern = ""
        for text, field in re.findall(r"([^{]*)(\{[^}]*\})?", self.filename or ""):
            pattern += re.escape(text)
            if field:  # {step} (with auto_insert_metric_name: step=N) is the number sorted on; other fields any text
                name = field[1:-1].split(":")[0]
                pattern += r"(?:step=)?(?P<step>\d+)" if name == "step" and "(?P<step>" not in pattern else ".+?"
        if "(?P<step>" not in pattern:
            return []
        found = re.compile(pattern + r"(?:-v\d+)?" + re.escape(self.FILE_EXTENSION))
        out = []
        for path in self._fs.ls(self.dirpath, detail=False):
            match = found.fullmatch(os.path.basename(os.path.normpath(path)))
            if match:
                out.append((int(match.group("step")), os.path.join(self.dirpath, os.path.basename(path))))
        return sorted(out, reverse=True)

    def _prune(self, trainer, written: str) -> None:
        """Delete all but the ``keep_last`` newest step files, once ``written`` is on disk."""
        if self.keep_last is None or not trainer.is_global_zero or not self._fs.exists(written):
            return
        for _, path in self._step_files()[self.keep_last:]:
            if os.path.abspath(path) != os.path.abspath(written):
                trainer.strategy.remove_checkpoint(path)

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)  # returns once the file is written (all ranks)
        self._prune(trainer, filepath)

    def on_train_end(self, trainer, pl_module):
        self._finishing = True
        try:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        finally:
            self._finishing = False

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        state = {"finished": self._finishing, "max_steps": trainer.max_steps, "max_epochs": trainer.max_epochs}
        checkpoint[RUN_STATE_KEY] = state
        return super().on_save_checkpoint(trainer, pl_module, checkpoint)


class EpochLines(L.Callback):
    """One line per training epoch on rank 0: epoch, optimizer step, train and validation loss, time since
    training started. The progress report of a run whose output is not a terminal (the progress bar is off)."""

    def __init__(self):
        super().__init__()
        self._t0 = time.perf_counter()

    def on_train_start(self, trainer, pl_module):
        self._t0 = time.perf_counter()

    def on_train_epoch_end(self, trainer, pl_module):
        if not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        losses = []
        for stage in ("train", "val"):
            value = metrics.get(f"{stage}/loss_epoch", metrics.get(f"{stage}/loss"))
            if value is not None:
                losses.append(f"{stage}/loss={float(value):.4g}")
        # numbered from 0 as in checkpoint names and the early-stopping report, with the count done beside it
        done = trainer.current_epoch + 1
        epochs = f" ({done}/{trainer.max_epochs})" if trainer.max_epochs and trainer.max_epochs > 0 else ""
        total = trainer.estimated_stepping_batches
        steps = f"/{int(total)}" if math.isfinite(total) and total > 0 else ""  # -1: an iterable without a limit
        print(f"[train] epoch {trainer.current_epoch}{epochs}, step {trainer.global_step}{steps}: "
              f"{', '.join(losses) or 'no loss logged'} ({time.perf_counter() - self._t0:.0f} s)", flush=True)


class GracefulInterrupt(L.Callback):
    """Ctrl-C (SIGINT) during training stops the run the way Lightning stops it on SIGTERM: at the end of the current
    optimizer step, on every rank together, raising ``SIGTERMException`` after the on-exception checkpoint
    (``LastCheckpoint``: ``step<N>.ckpt`` and ``last.ckpt``), never halfway through an optimizer update. A
    second Ctrl-C on rank 0 interrupts at once. ``signal``: "SIGINT" once Ctrl-C stopped the run, else None
    (a ``SIGTERMException`` then came from SIGTERM). The training entry point adds it to every run."""

    def __init__(self):
        super().__init__()
        self.signal: str | None = None
        self._previous = None
        self._rank = 0

    def on_train_start(self, trainer, pl_module):
        # (after Lightning has put in its SIGTERM handler, which its teardown puts back as it found it)
        self.signal, self._rank = None, trainer.global_rank
        if threading.current_thread() is threading.main_thread():  # signal handlers: main thread only
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame):
        # during fit the SIGTERM handler is Lightning's: it flags the trainer and, like on SIGTERM, passes
        # the signal to the ranks it launched; each rank calls it once (its broadcast pairs with rank 0's)
        lightning_handler = signal.getsignal(signal.SIGTERM)
        if self.signal is not None or not callable(lightning_handler):
            if self._rank == 0 or not callable(lightning_handler):
                signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt now
            return  # other ranks hear a Ctrl-C twice (terminal and rank 0): rank 0 decides
        self.signal = "SIGINT"
        if self._rank == 0:
            print("\n[train] Ctrl-C: stopping after this step with a checkpoint (Ctrl-C again stops at once)",
                  file=sys.stderr, flush=True)
        lightning_handler(signum, frame)

    def _restore(self):
        if self._previous is not None or signal.getsignal(signal.SIGINT) == self._on_sigint:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, signal.default_int_handler if self._previous is None else self._previous)
        self._previous = None

    def on_train_end(self, trainer, pl_module):
        self._restore()

    def on_exception(self, trainer, pl_module, exception):
        self._restore()


class ReportingEarlyStopping(EarlyStopping):
    """Lightning's EarlyStopping that says when and why it stopped (``self.report``; printed once)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.report: str | None = None

    def _run_early_stopping_check(self, trainer):
        before = trainer.should_stop
        super()._run_early_stopping_check(trainer)
        reason = getattr(self, "stopping_reason_message", None)
        if trainer.should_stop and not before and self.report is None and reason:
            self.report = (
                f"early stopping after epoch {trainer.current_epoch} (step {trainer.global_step}, "
                f"patience {self.patience}, min_delta {abs(self.min_delta):g}): {reason}"
            )
            if trainer.is_global_zero:
                print(f"[train] {self.report}", flush=True)


class LengthWarmup(L.Callback):
    """Before the first training step, one throwaway training step per batch width the data can produce (with
    ``data.length_multiple`` > 1: ``datamodule.warmup_batches()``), first inside ``attn_ops.compile_ahead()`` (every
    Triton kernel those steps need compiles at once) and then for real (cuBLAS meets each GEMM shape once,
    the tuner times any key it has no config for), so that the run does not stall at its first batch of each width.

    Nothing is learned: the steps' gradients are dropped, no optimizer step runs, and the random number generators
    are restored afterwards (a run with the warm-up takes the steps one without it takes). Not where the strategy
    wraps the module (DDP, FSDP, several processes: skipped with a warning, as the warm-up's steps would not pass
    through the wrapper). Where the data tells MSA depths, each width's batch has the row count a training batch of
    that width most likely gets (the deepest of that width and narrower, ``warmup_batches``); a training batch whose
    examples are all shallower still meets a new row count. ``enabled`` False: off.
    ``max_widths``: more widths than this is an error (a multiple too small for the data). After the warm-up,
    ``summary`` holds the widths and the seconds it took.
    """

    def __init__(self, enabled: bool = True, max_widths: int = 64):
        super().__init__()
        if max_widths < 1:
            raise ValueError(f"LengthWarmup: max_widths must be >= 1, got {max_widths}")
        self.enabled, self.max_widths = enabled, max_widths
        self.summary: dict = {}

    def on_train_start(self, trainer, pl_module):
        warmup = getattr(trainer.datamodule, "warmup_batches", None)
        if not self.enabled or warmup is None:
            return
        if trainer.world_size > 1 or trainer.strategy.model is not pl_module:
            import warnings

            warnings.warn(f"LengthWarmup: skipped under {type(trainer.strategy).__name__} (world size "
                          f"{trainer.world_size}): its steps would not pass through the strategy's wrapper",
                          RuntimeWarning)
            return
        import attn_ops

        device = pl_module.device
        rng = dict(devices=[]) if device.type == "cpu" else dict(devices=[device], device_type=device.type)
        # (the examples' random crops and masks draw from the generators too)
        with torch.random.fork_rng(**rng):
            batches = warmup(self.max_widths)
            if not batches:
                return
            t0 = time.perf_counter()
            # (the throwaway steps' values are garbage: no anomaly check there)
            with attn_ops.compile_ahead(), torch.autograd.set_detect_anomaly(False):
                for _, batch in batches:
                    self._step(trainer, pl_module, batch)
            ahead = time.perf_counter() - t0
            for _, batch in batches:
                self._step(trainer, pl_module, batch)
        self._sync(pl_module)
        self.summary = dict(widths=[w for w, _ in batches], seconds=time.perf_counter() - t0, compile_ahead_s=ahead)
        print(f"length warm-up: {len(batches)} widths ({', '.join(str(w) for w, _ in batches)}) in "
              f"{self.summary['seconds']:.1f} s (kernels compiled ahead in {ahead:.1f} s)", flush=True)

    @staticmethod
    def _step(trainer, pl_module, batch):
        # the fit loop's way into a training step: the module's transfer hooks, the precision plugin's input cast
        batch = pl_module.on_before_batch_transfer(batch, 0)
        batch = pl_module.transfer_batch_to_device(batch, pl_module.device, 0)
        batch = trainer.precision_plugin.convert_input(pl_module.on_after_batch_transfer(batch, 0))
        with trainer.precision_plugin.train_step_context():
            loss = pl_module.step(batch)[0]
        loss.backward()
        pl_module.zero_grad(set_to_none=True)

    @staticmethod
    def _sync(pl_module):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
