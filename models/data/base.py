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
        padded to ``length_multiple`` > 1, in increasing width, collated as the loader collates
        (``callbacks.LengthWarmup`` steps through them before training): ``batch_size`` examples, the first of
        which pads to that width. Where the training set tells each example's MSA rows (``depths()``), a batch has
        as many rows as the deepest of its examples, narrower ones included, so the first is the width's deepest
        example and the others are the deepest example of that width or narrower: the row count a training batch
        of that width most likely gets (the attention kernels' tuning keys include it); else all are copies of the
        width's first example. Empty when ``length_multiple`` is 1 (a width per length: nothing bounds them) or the
        training set cannot tell its examples' lengths (``lengths()``). More than ``max_widths`` widths: ValueError."""
        from ..shapes import round_up

        multiple = self.hparams.get("length_multiple", 1)
        if multiple <= 1:
            return []
        self.setup("fit")
        ds = self.train_set
        if ds is None or not hasattr(ds, "lengths"):
            return []
        widths = [round_up(n, multiple) for n in ds.lengths()]
        depths = ds.depths() if hasattr(ds, "depths") else [0] * len(widths)
        pick = {}  # width -> the first of its deepest examples
        for i, w in enumerate(widths):
            if w not in pick or depths[i] > depths[pick[w]]:
                pick[w] = i
        if len(pick) > max_widths:
            raise ValueError(f"warmup_batches: the training set pads to {len(pick)} widths (multiples of "
                             f"{multiple} from {min(pick)} to {max(pick)}), more than max_widths={max_widths}")
        collate = self._loader(ds, shuffle=False).collate_fn
        out, deepest = [], None  # deepest: the first of the deepest examples up to this width
        for w, i in sorted(pick.items()):
            if deepest is None or depths[i] > depths[deepest]:
                deepest = i
            out.append((w, collate([ds[i]] + [ds[deepest]] * (self.hparams.batch_size - 1))))
        return out

    def train_dataloader(self):
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self):
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self):
        return self._loader(self.test_set, shuffle=False)
