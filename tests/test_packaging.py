"""The wheel, installed into a clean environment beside a user's own package named ``models``.

Built with pip from this checkout, installed with ``--target`` into a temporary folder, and imported by a
Python started with ``-S`` (no site-packages ``.pth`` files, so no editable finder) from a folder that holds
only the user's ``models`` package: nothing of the repository is on ``sys.path`` there.
"""
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    dist, site = tmp / "dist", tmp / "site"
    run = dict(check=True, capture_output=True, text=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(ROOT)], **run)
    wheels = list(dist.glob("attn_zoo-*.whl"))
    assert len(wheels) == 1, wheels
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheels[0])],
                   **run)
    user = tmp / "user_project"
    (user / "models").mkdir(parents=True)
    (user / "models" / "__init__.py").write_text("OWNER = 'user'\n")
    (user / "models" / "evoformer.py").write_text("OWNER = 'user evoformer'\n")
    return site, user


def run_clean(site: Path, user: Path, code: str, *args: str) -> subprocess.CompletedProcess:
    """``python -S`` in the user's folder: the installed wheel, then the interpreter's own packages (torch, ...)."""
    deps = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ATTN_ZOO_ROOT")}
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + deps)
    return subprocess.run([sys.executable, "-S", "-c", textwrap.dedent(code), *args], cwd=user, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_wheel_layout(installed):
    site, _ = installed
    assert (site / "attn_zoo" / "models" / "pairformer.py").is_file()
    assert (site / "attn_zoo" / "configs" / "train.yaml").is_file()
    assert (site / "attn_zoo" / "configs" / "experiment" / "evoformer_msa.yaml").is_file()
    assert any((site / "attn_zoo" / "models" / "data" / "sample" / "msa").glob("*.a3m"))
    assert (site / "attn_ops" / "triton").is_dir()
    assert any((site / "attn_ops" / "triton" / "tuned").glob("*.json")), "the shipped tuning tables"
    assert not (site / "models").exists(), "the wheel must not install a top-level `models` package"


@pytest.mark.slow
def test_installed_imports_beside_user_models(installed):
    site, user = installed
    proc = run_clean(site, user, """
        import json, sys
        import models                                           # the user's own package, first
        import torch
        from attn_ops import attention
        from attn_zoo.models.pairformer import PairformerBlock
        from attn_zoo.models.evoformer import EvoformerBlock
        from attn_zoo.models.data import SAMPLE_DIR
        import models.evoformer as user_evo                     # still the user's, after ours
        block = PairformerBlock(c_s=16, c_z=8, num_heads_single=2, num_heads_pair=2, c_hidden_pair=4, c_hidden_mul=8, attention="torch")
        s, z = block(torch.randn(1, 5, 16), torch.randn(1, 5, 5, 8))
        ours = [m.__file__ for n, m in sys.modules.items()
                if n.split(".")[0] in ("attn_zoo", "attn_ops") and getattr(m, "__file__", None)]
        print(json.dumps(dict(user=models.OWNER, user_evo=user_evo.OWNER, shape=list(z.shape), ours=ours,
                              sample=str(SAMPLE_DIR), cwd_path=sys.path[0])))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["user"] == "user" and out["user_evo"] == "user evoformer"
    assert out["shape"] == [1, 5, 5, 8]
    assert out["ours"] and all(f.startswith(str(site)) for f in out["ours"]), out["ours"]
    assert out["sample"].startswith(str(site))


@pytest.mark.slow
def test_installed_train_entry_composes_from_any_folder(installed):
    site, user = installed
    # Hydra's --cfg job prints the composed config and exits: the configs are found inside the package.
    proc = run_clean(site, user, """
        import sys
        from attn_zoo.train import main
        sys.argv = ["attn-zoo-train", "--cfg", "job", "experiment=pairformer_msa"]
        main()
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "_target_: attn_zoo.models.tasks" in proc.stdout
    assert "PairformerStack" in proc.stdout
