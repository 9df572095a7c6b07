"""What the data modules share: a data report written before training, the test-set question the training
entry point asks, and train/val/test loaders built by one ``_loader(dataset, shuffle)`` per module."""
from __future__ import annotations

import lightning as L


class SplitDataModule(L.LightningDataModule):
    """A data module with ``train_set``/``val_set``/``test_set`` (None when a split is empty) set by ``setup`` and
    a ``report`` (``sources.DataReport``); subclasses give ``setup`` and ``_loader``."""

    def prepare_report(self, folder=None):
        """Read and split the data now (a data error stops a run before the model is built) and write
        ``data.json`` (files, proteins kept/dropped, splits) into ``folder``."""
        self.setup("fit")
        if folder is not None:
            self.report.write(folder)

    def has_test_set(self) -> bool:
        self.setup("test")
        return self.test_set is not None

    def _loader(self, ds, shuffle):
        raise NotImplementedError

    def warmup_batches(self, max_widths: int = 64) -> list:
        """[(width, batch)]: one training batch for each width the training loader can produce when lengths are
        padded to ``length_multiple`` > 1, in increasing width: ``batch_size`` copies of one example whose length
        pads to that width, collated as the loader collates (``callbacks.LengthWarmup`` steps through them before
        training). Where the training set tells each example's MSA rows (``depths()``), the example is the deepest
        of its width: a batch has as many rows as its deepest example, so this is the row count most training
        batches of that width get (the attention kernels' tuning keys include it). Empty when ``length_multiple``
        is 1 (a width per length: nothing bounds them) or the training set cannot tell its examples' lengths
        (``lengths()``). More than ``max_widths`` widths: ValueError."""
        from ..primitives import round_up

        multiple = self.hparams.get("length_multiple", 1)
        if multiple <= 1:
            return []
        self.setup("fit")
        ds = self.train_set
        if ds is None or not hasattr(ds, "lengths"):
            return []
        depths = ds.depths() if hasattr(ds, "depths") else None
        pick = {}  # width -> the first of its deepest examples
        for i, n in enumerate(ds.lengths()):
            w = round_up(n, multiple)
            if w not in pick or (depths is not None and depths[i] > depths[pick[w]]):
                pick[w] = i
        if len(pick) > max_widths:
            raise ValueError(f"warmup_batches: the training set pads to {len(pick)} widths (multiples of "
                             f"{multiple} from {min(pick)} to {max(pick)}), more than max_widths={max_widths}")
        collate = self._loader(ds, shuffle=False).collate_fn
        return [(w, collate([ds[i]] * self.hparams.batch_size)) for w, i in sorted(pick.items())]

    def train_dataloader(self):
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self):
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self):
        return self._loader(self.test_set, shuffle=False)
