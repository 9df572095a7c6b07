"""Train any attn-zoo model from configs, from a checkout: ``python train.py experiment=...``.

The code lives in ``attn_zoo/train.py``; installed, the same command is ``attn-zoo-train experiment=...``.
"""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
os.environ.setdefault("ATTN_ZOO_ROOT", str(ROOT))  # a checkout's runs land in its logs/ folder
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from attn_zoo.train import main, train  # noqa: E402,F401

if __name__ == "__main__":
    main()
