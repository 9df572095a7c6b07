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

    def train_dataloader(self):
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self):
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self):
        return self._loader(self.test_set, shuffle=False)
