#!/bin/bash
# OpenFold3's and Protenix's Pairformer modules for scripts/bench_zoo.py --cases of3-pairformer protenix-pairformer
# (gpu_suite.sh's zoo-af3 stage) on a machine that has Python 3.12, torch, triton, numpy, scipy, PyYAML, absl-py and
# packaging but neither project, and no network: installed into .whl/site (ignored by git; a device call names .whl
# in carry, and gpu_suite.sh puts .whl/site on PYTHONPATH). Run from the repository root on any machine with pip.
#
# What the two import chains need beyond that machine's packages (python -X importtime of
# openfold3.core.model.latent.pairformer and protenix.model.modules.pairformer):
#   openfold3     openfold3/__init__ imports gemmi (binary) and packaging; the Pairformer's layers ml_collections
#                 (pure, needs absl-py and PyYAML), scipy.stats (initialisation) and triton (its kernels)
#   protenix      protenix.model.utils imports optree (binary) and scipy
# Left out, each too large for a device call's 64 MiB carry: biotite (~126 MB installed; imported by
# openfold3.core.utils.tensor_utils for one isinstance test) and rdkit (~136 MB; imported by protenix.data.constants
# for its element list, which protenix.model.modules.pairformer reads only STD_RESIDUES_WITH_GAP from). bench_zoo.py
# imports the Pairformers with a stand-in module for each missing one and says so in its rows.
# Binary wheels: CPython 3.12, manylinux_2_28 x86_64 (gemmi 0.7.5 has no manylinux2014 wheel). WHL_PYTHON and
# WHL_SITE change the Python version and the folder, e.g. to check the set in a bare venv of another Python.
set -euo pipefail
site=${WHL_SITE:-.whl/site}
py=${WHL_PYTHON:-3.12}
mkdir -p "$site"
python3 -m pip install -q --no-deps --upgrade --target "$site" openfold3==0.5.0 protenix==2.0.0 ml-collections==1.1.0
python3 -m pip install -q --no-deps --upgrade --target "$site" --python-version "$py" --only-binary=:all: \
  --platform manylinux_2_28_x86_64 gemmi==0.7.5 optree==0.17.0
# openfold3's wheel ships 61 MB of test data (mmCIF files, alignments) that no import reads; protenix's puts its
# repository's configs, runner, scripts and tests folders at the top level, where `tests` and `scripts` would shadow
# this repository's own on PYTHONPATH (the Pairformer's chain imports none of them)
rm -rf "$site/openfold3/tests" "$site/configs" "$site/runner" "$site/scripts" "$site/tests"
# pip's --target leaves a bin/ of console scripts written for this machine's Python: nothing imports them
rm -rf "$site/bin"
du -sh "$(dirname "$site")"
