"""Embed a FASTA file with an ESM-2 the zoo loads, from a checkout: ``python scripts/embed.py --model M --fasta F
--out DIR``. The code lives in ``attn_zoo/embed.py``; installed, the same command is ``attn-zoo-embed``."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from attn_zoo.embed import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())  # 0 on success, 1 with one line on stderr for bad input
